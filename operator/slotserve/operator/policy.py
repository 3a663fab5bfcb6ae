"""What a pool may ask of the cluster: pure checks run before any child is written.

Creating an InferencePool creates pods, so whoever may create pools could otherwise mount node
folders, run any image or borrow any ServiceAccount of the namespace. The operator refuses such
pools with a reason (the pool turns Degraded, a Warning event says why, no child is written);
platform teams widen the rules through the operator's settings. Pure functions, tested directly.

Also here: which of several pools serving one model name wins (the oldest), the rule the
gateway applies too, so that the operator can flag the others.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from slotserve.operator.models import InferencePool
from slotserve.operator.status import Problem

# Pod annotations that switch off the AppArmor or seccomp confinement (legacy forms that
# kubelets still honour): refused, they would defeat the pod's security context.
CONFINEMENT_ANNOTATION_PREFIXES = (
    "container.apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
)

# Environment variables that load code from somewhere other than the image (a library, a
# Python path on a volume the pool author fills): they would run any program inside an allowed
# image, and serving a model never needs them.
CODE_LOADING_ENV = frozenset(
    {
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONUSERBASE",
        "PYTHONEXECUTABLE",
    }
)


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
    full = normalize_image(image)
    return any(fnmatch.fnmatchcase(full, pattern) for pattern in patterns)


def service_account_allowed(namespace: str, name: str, patterns: Iterable[str]) -> bool:
    """Whether ServiceAccount ``namespace/name`` matches a ``name`` or ``namespace/name`` glob."""
    return any(
        fnmatch.fnmatchcase(f"{namespace}/{name}" if "/" in pattern else name, pattern)
        for pattern in patterns
    )


@dataclass(frozen=True)
class Policy:
    """The operator's rules for pools (from OperatorSettings)."""

    engine_image: str
    allow_host_path: bool = False
    allowed_images: Sequence[str] = ()
    allowed_service_accounts: Sequence[str] = ()

    def check(self, pool: InferencePool) -> Problem | None:
        """The first rule ``pool`` breaks, as a condition reason and message; None if none."""
        engine = pool.spec.engine
        if pool.spec.model.source.host_path is not None and not self.allow_host_path:
            return Problem(
                "HostPathNotAllowed",
                "model.source.hostPath mounts a node folder into the engine pods; this "
                "operator refuses it (setting allow_host_path, chart value "
                "policy.allowHostPath). Use a PersistentVolumeClaim (model.source.pvc).",
            )
        image = engine.image or self.engine_image
        if self.allowed_images and not image_allowed(image, self.allowed_images):
            return Problem(
                "ImageNotAllowed",
                f"engine image {normalize_image(image)!r} matches none of the allowed images "
                f"{list(self.allowed_images)}",
            )
        account = engine.service_account_name
        if (
            account
            and self.allowed_service_accounts
            and not service_account_allowed(
                pool.metadata.namespace, account, self.allowed_service_accounts
            )
        ):
            return Problem(
                "ServiceAccountNotAllowed",
                f"ServiceAccount {account!r} matches none of the allowed ServiceAccounts "
                f"{list(self.allowed_service_accounts)}",
            )
        for var in engine.env:
            if var.name in CODE_LOADING_ENV:
                return Problem(
                    "EnvNotAllowed",
                    f"engine.env {var.name} would load code from outside the engine image",
                )
        for key in engine.pod_annotations:
            if key.startswith(CONFINEMENT_ANNOTATION_PREFIXES):
                return Problem(
                    "PodAnnotationNotAllowed",
                    f"pod annotation {key!r} changes the pods' AppArmor/seccomp confinement",
                )
        return None


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
