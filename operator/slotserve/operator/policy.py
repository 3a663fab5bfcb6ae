"""What a pool may ask of the cluster: pure checks run before any child is written.

Creating an InferencePool creates pods, so whoever may create pools could otherwise mount node
folders, run any image or borrow any ServiceAccount of the namespace, run their own code inside
an allowed image through environment variables, land on nodes kept for others, preempt other
namespaces' pods, or point KEDA at any URL. The operator refuses such pools with a reason (the
pool turns Degraded, a Warning event says why, no child is written or changed: pods that already
run keep running); platform teams widen the rules through the operator's settings. The rules that
guard code execution and scheduling are allow-lists: a name nobody thought of is refused. Pure
functions, tested directly.

Also here: which of several pools serving one model name wins (the oldest), the rule the
gateway applies too, so that the operator can flag the others.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from slotserve.operator.builders import OPERATOR_ENV_NAMES
from slotserve.operator.models import InferencePool, Toleration
from slotserve.operator.status import Problem

# Pod annotations that switch off the AppArmor or seccomp confinement (legacy forms that
# kubelets still honour): refused, they would defeat the pod's security context.
CONFINEMENT_ANNOTATION_PREFIXES = (
    "container.apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
)

# Environment variables a pool may set without the platform naming them: each changes how the
# engine's libraries behave (offline mode, thread counts, the CUDA allocator), none names a file,
# a folder, a program or a host. Anything else, whatever its name, is refused unless the platform
# adds it (setting allowed_env, chart value policy.allowedEnv): names such as LD_PRELOAD,
# PYTHONPATH, CC, CPATH, LIBRARY_PATH, PYTHONPYCACHEPREFIX, SLOTSERVE_HOME or HF_ENDPOINT load
# or run code, or send the Hub token, from a place the pool author chooses.
DEFAULT_ALLOWED_ENV = frozenset(
    {
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY",
        "HF_HUB_DISABLE_PROGRESS_BARS",
        "HF_HUB_DOWNLOAD_TIMEOUT",
        "HF_HUB_ETAG_TIMEOUT",
        "TOKENIZERS_PARALLELISM",
        "OMP_NUM_THREADS",
        "PYTORCH_CUDA_ALLOC_CONF",
    }
)

TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


@dataclass(frozen=True)
class TolerationRule:
    """Tolerations a pool may carry: taint ``key`` (a glob; ``*`` = any, also a toleration
    without a key, which tolerates every taint) with ``effect`` (None = any effect)."""

    key: str
    effect: TaintEffect | None = None

    def admits(self, toleration: Toleration) -> bool:
        key = toleration.key
        key_ok = self.key == "*" or bool(key and fnmatch.fnmatchcase(key, self.key))
        # A toleration without an effect tolerates every effect: only a rule without one covers it.
        return key_ok and (self.effect is None or self.effect == toleration.effect)


# The scheduling the default (multi-tenant) settings allow: what the platform's own GPU nodes
# need (the NVIDIA GPU operator's taint and labels, as examples/llama-8b-gpu.yaml uses); no
# PriorityClass, no other taint, no other node label, no KEDA server.
DEFAULT_ALLOWED_TOLERATIONS = (TolerationRule("nvidia.com/gpu", "NoSchedule"),)
DEFAULT_ALLOWED_NODE_SELECTOR_KEYS = ("nvidia.com/gpu.present", "nvidia.com/gpu.product")


def normalize_image(image: str) -> str:
    """The full reference of ``image`` as the container runtime resolves it.

    ``nginx`` is ``docker.io/library/nginx`` and ``team/app`` is ``docker.io/team/app``: a
    pattern such as ``docker.io/library/*`` must not be bypassed by leaving the registry out.
    """
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"docker.io/{image}" if slash else f"docker.io/library/{image}"


def image_allowed(image: str, patterns: Iterable[str]) -> bool:
    """Whether ``image`` (normalized) matches one of the glob ``patterns``."""
    return globs_allow(normalize_image(image), patterns)


def service_account_allowed(namespace: str, name: str, patterns: Iterable[str]) -> bool:
    """Whether ServiceAccount ``namespace/name`` matches a ``name`` or ``namespace/name`` glob."""
    return any(
        fnmatch.fnmatchcase(f"{namespace}/{name}" if "/" in pattern else name, pattern)
        for pattern in patterns
    )


def globs_allow(value: str, patterns: Iterable[str]) -> bool:
    """Whether ``value`` matches one of the glob ``patterns`` (``*`` matches anything)."""
    return any(fnmatch.fnmatchcase(value, pattern) for pattern in patterns)


def keda_server_allowed(address: str, allowed: Iterable[str]) -> bool:
    """Whether KEDA may query ``address``: one of ``allowed`` exactly (a trailing ``/`` aside;
    no globs: ``http://prom:9090*`` would also match ``http://prom:9090@evil``), or ``*``."""
    address = address.rstrip("/")
    return any(entry == "*" or entry.rstrip("/") == address for entry in allowed)


@dataclass(frozen=True)
class Policy:
    """The operator's rules for pools (from OperatorSettings)."""

    engine_image: str
    allow_host_path: bool = False
    allowed_images: Sequence[str] = ()
    allowed_service_accounts: Sequence[str] = ()
    allowed_env: frozenset[str] = DEFAULT_ALLOWED_ENV
    allowed_priority_classes: Sequence[str] = ()
    allowed_tolerations: Sequence[TolerationRule] = DEFAULT_ALLOWED_TOLERATIONS
    allowed_node_selector_keys: Sequence[str] = DEFAULT_ALLOWED_NODE_SELECTOR_KEYS
    allowed_keda_server_addresses: Sequence[str] = ()

    def check(self, pool: InferencePool) -> Problem | None:
        """The first rule ``pool`` breaks, as a condition reason and message; None if none."""
        for rule in (
            self._host_path,
            self._image,
            self._service_account,
            self._env,
            self._pod_annotations,
            self._priority_class,
            self._tolerations,
            self._node_selector,
            self._keda_server,
        ):
            problem = rule(pool)
            if problem is not None:
                return problem
        return None

    def _host_path(self, pool: InferencePool) -> Problem | None:
        if pool.spec.model.source.host_path is None or self.allow_host_path:
            return None
        return Problem(
            "HostPathNotAllowed",
            "model.source.hostPath mounts a node folder into the engine pods; this "
            "operator refuses it (setting allow_host_path, chart value "
            "policy.allowHostPath). Use a PersistentVolumeClaim (model.source.pvc).",
        )

    def _image(self, pool: InferencePool) -> Problem | None:
        image = pool.spec.engine.image or self.engine_image
        if not self.allowed_images or image_allowed(image, self.allowed_images):
            return None
        return Problem(
            "ImageNotAllowed",
            f"engine image {normalize_image(image)!r} matches none of the allowed images "
            f"{list(self.allowed_images)}",
        )

    def _service_account(self, pool: InferencePool) -> Problem | None:
        account = pool.spec.engine.service_account_name
        if (
            not account
            or not self.allowed_service_accounts
            or service_account_allowed(
                pool.metadata.namespace, account, self.allowed_service_accounts
            )
        ):
            return None
        return Problem(
            "ServiceAccountNotAllowed",
            f"ServiceAccount {account!r} matches none of the allowed ServiceAccounts "
            f"{list(self.allowed_service_accounts)}",
        )

    def _env(self, pool: InferencePool) -> Problem | None:
        names = [var.name for var in pool.spec.engine.env]
        owned = sorted({name for name in names if name in OPERATOR_ENV_NAMES})
        if owned:
            return Problem(
                "EnvNotAllowed",
                f"engine.env sets {', '.join(owned)}: the operator sets "
                f"{'it' if len(owned) == 1 else 'them'} on every engine pod, a pool cannot",
            )
        refused = sorted({name for name in names if name not in self.allowed_env})
        if not refused:
            return None
        return Problem(
            "EnvNotAllowed",
            f"engine.env sets {', '.join(refused)}: not on the platform's list of variables a "
            f"pool may set ({', '.join(sorted(self.allowed_env))}; setting allowed_env, chart "
            "value policy.allowedEnv). Variables outside it can load or run code from outside "
            "the engine image.",
        )

    def _pod_annotations(self, pool: InferencePool) -> Problem | None:
        for key in pool.spec.engine.pod_annotations:
            if key.startswith(CONFINEMENT_ANNOTATION_PREFIXES):
                return Problem(
                    "PodAnnotationNotAllowed",
                    f"pod annotation {key!r} changes the pods' AppArmor/seccomp confinement",
                )
        return None

    def _priority_class(self, pool: InferencePool) -> Problem | None:
        name = pool.spec.engine.priority_class_name
        if not name or globs_allow(name, self.allowed_priority_classes):
            return None
        return Problem(
            "PriorityClassNotAllowed",
            f"engine.priorityClassName {name!r} matches none of the allowed PriorityClasses "
            f"{list(self.allowed_priority_classes)} (setting allowed_priority_classes, chart "
            "value policy.allowedPriorityClasses): it could preempt other teams' pods",
        )

    def _tolerations(self, pool: InferencePool) -> Problem | None:
        for toleration in pool.spec.engine.tolerations:
            if not any(rule.admits(toleration) for rule in self.allowed_tolerations):
                shown = f"{toleration.key or '(every taint)'}:{toleration.effect or '(any effect)'}"
                allowed = [f"{r.key}:{r.effect or '*'}" for r in self.allowed_tolerations]
                return Problem(
                    "TolerationNotAllowed",
                    f"engine.tolerations {shown} matches none of the allowed tolerations "
                    f"{allowed} (setting allowed_tolerations, chart value "
                    "policy.allowedTolerations): it would land pods on nodes kept for others",
                )
        return None

    def _node_selector(self, pool: InferencePool) -> Problem | None:
        refused = sorted(
            key
            for key in pool.spec.engine.node_selector
            if not globs_allow(key, self.allowed_node_selector_keys)
        )
        if not refused:
            return None
        return Problem(
            "NodeSelectorNotAllowed",
            f"engine.nodeSelector keys {', '.join(refused)} match none of the allowed keys "
            f"{list(self.allowed_node_selector_keys)} (setting allowed_node_selector_keys, "
            "chart value policy.allowedNodeSelectorKeys)",
        )

    def _keda_server(self, pool: InferencePool) -> Problem | None:
        autoscaling = pool.spec.autoscaling
        keda = autoscaling.keda if autoscaling is not None else None
        if (
            autoscaling is None
            or autoscaling.provider != "keda"
            or keda is None
            or keda_server_allowed(keda.server_address, self.allowed_keda_server_addresses)
        ):
            return None
        return Problem(
            "KedaServerNotAllowed",
            f"autoscaling.keda.serverAddress {keda.server_address!r} is none of the allowed "
            f"addresses {list(self.allowed_keda_server_addresses)} (setting "
            "allowed_keda_server_addresses, chart value policy.allowedKedaServerAddresses): "
            "KEDA would send its queries wherever it points",
        )


@dataclass(frozen=True)
class ModelClaim:
    """One pool's claim on a model name; the oldest claim wins."""

    namespace: str
    name: str
    model: str
    created: str  # metadata.creationTimestamp (RFC 3339, UTC: sorts as text)

    @property
    def rank(self) -> tuple[str, str, str]:
        return (self.created, self.namespace, self.name)


def model_name_winner(claim: ModelClaim, claims: Iterable[ModelClaim]) -> ModelClaim | None:
    """The pool that serves ``claim.model`` instead of ``claim``'s pool; None if it is its own.

    Oldest wins: creationTimestamp first, then namespace/name (the gateway's rule too).
    """
    me = (claim.namespace, claim.name)
    rivals = [
        other
        for other in claims
        if other.model == claim.model and (other.namespace, other.name) != me
    ]
    if not rivals:
        return None
    oldest = min([claim, *rivals], key=lambda other: other.rank)
    return None if oldest is claim else oldest


def model_name_problem(winner: ModelClaim, model: str) -> Problem:
    return Problem(
        "ModelNameConflict",
        f"model name {model!r} is already served by the older pool "
        f"{winner.namespace}/{winner.name}; the gateway routes it there. Rename spec.model.name "
        "or delete one of the pools.",
    )
