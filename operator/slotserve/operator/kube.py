"""The thin I/O layer: Kubernetes client configuration and create-or-patch of owned children.

Objects travel as plain dicts (``kube_api.KubeApi``, on kopf's event loop), exactly as the
builders make them and as the API returns them, so comparisons need no model round trips.

Children are written with JSON merge patches (not server-side apply): read, compare, and patch
only when something differs, with the read's resourceVersion as a compare-and-swap. The pod
template is owned whole, so keys the pool no longer sets are nulled out of it. This works the
same on every API server, including the emulator the tests use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import kopf
import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

from slotserve.contracts.crd import GROUP, KIND, PLURAL, VERSION
from slotserve.operator.drift import in_sync, is_subset
from slotserve.operator.kube_api import MERGE_PATCH, KubeApi, object_path

__all__ = [
    "MERGE_PATCH",
    "ChildConflictError",
    "Children",
    "in_sync",
    "is_subset",
    "replacing_patch",
]

USER_AGENT = "slotserve-operator"
Outcome = Literal["created", "patched", "unchanged", "deleted"]


class ChildConflictError(Exception):
    """A child's name is taken by an object that this pool does not own."""


def load_configuration() -> kubernetes.client.Configuration:
    """In-cluster service account if there is one, else the kubeconfig file.

    ``$KUBECONFIG`` is read now, not when the kubernetes package was imported (it caches it).
    """
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or "~/.kube/config"
        kubernetes.config.load_kube_config(
            config_file=str(Path(path).expanduser()), client_configuration=configuration
        )
    return configuration


def connection_info(configuration: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """The same credentials, in kopf's terms (what ``kopf.login_via_client`` does)."""
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    # "Bearer TOKEN", or a bare token.
    parts = (header or "").split(" ", 1)
    scheme, token = parts if len(parts) == 2 else (None, parts[0] or None)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def replacing_patch(live: Any, desired: Any) -> Any:
    """A JSON merge patch that turns ``live`` into exactly ``desired``.

    Keys only ``live`` has are set to null (removed; the server re-applies its defaults), so a
    field removed from the pool disappears from the child too. Lists are replaced whole.
    """
    if not (isinstance(live, dict) and isinstance(desired, dict)):
        return desired
    patch: dict[str, Any] = {key: None for key in live if key not in desired}
    patch.update({key: replacing_patch(live.get(key), value) for key, value in desired.items()})
    return patch


@dataclass(frozen=True)
class ChildKind:
    """How a kind of child is written: its plural (for the path) and the parts of its spec that
    we own whole (removals must propagate; the rest is merged). ``"*"``: the whole spec, keys
    only the live object has are removed too."""

    plural: str
    replaced_spec_keys: tuple[str, ...]


# Keyed by apiVersion too: the Gateway API's InferencePool shares our kind name.
CHILD_KINDS: dict[tuple[str, str], ChildKind] = {
    ("apps/v1", "Deployment"): ChildKind("deployments", ("template",)),
    ("v1", "Service"): ChildKind("services", ("selector",)),
    ("networking.k8s.io/v1", "NetworkPolicy"): ChildKind("networkpolicies", ("*",)),
    ("keda.sh/v1alpha1", "ScaledObject"): ChildKind("scaledobjects", ("*",)),
    ("inference.networking.k8s.io/v1", "InferencePool"): ChildKind("inferencepools", ("*",)),
}
# Children that a pool's spec (or the operator's settings) may stop asking for; the rest are
# always wanted while the pool exists.
OPTIONAL_CHILDREN: tuple[tuple[str, str], ...] = (
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
)
POOL_API_VERSION = f"{GROUP}/{VERSION}"


class Children:
    """Create-or-patch of a pool's children, and status writes of pools."""

    def __init__(self, api: KubeApi) -> None:
        self.api = api

    async def crd_exists(self, name: str) -> bool:
        """Whether the CustomResourceDefinition ``name`` is installed (e.g. KEDA's)."""
        try:
            await self.api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    async def autoscalers_of_pool(self, namespace: str, name: str) -> list[str]:
        """Names of the HorizontalPodAutoscalers whose target is the pool."""
        listed = await self.api.get(
            object_path("autoscaling/v2", "horizontalpodautoscalers", namespace)
        )
        return [
            hpa["metadata"]["name"]
            for hpa in listed.get("items") or []
            if (ref := (hpa.get("spec") or {}).get("scaleTargetRef") or {}).get("kind") == KIND
            and ref.get("name") == name
            and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/")
        ]

    async def scale_pool(self, namespace: str, name: str, replicas: int) -> None:
        """Set the pool's replicas through its scale subresource (what an HPA does)."""
        path = object_path(POOL_API_VERSION, PLURAL, namespace, name) + "/scale"
        await self.api.merge_patch(path, {"spec": {"replicas": replicas}})

    async def apply(self, desired: dict[str, Any], *, owner_uid: str) -> Outcome:
        """Create ``desired`` or patch the live object towards it; raises ChildConflictError."""
        kind = CHILD_KINDS[(desired["apiVersion"], desired["kind"])]
        name, namespace = desired["metadata"]["name"], desired["metadata"]["namespace"]
        path = object_path(desired["apiVersion"], kind.plural, namespace, name)
        try:
            live = await self.api.get(path)
        except ApiException as error:
            if error.status != 404:
                raise
            if await self._owner_pool_gone(desired, owner_uid):
                # A converge that began before its pool was deleted must not re-create children
                # the garbage collector has just removed (they would dangle until GC runs again).
                return "unchanged"
            await self.api.create(
                object_path(desired["apiVersion"], kind.plural, namespace), desired
            )
            return "created"
        owners = live["metadata"].get("ownerReferences") or []
        if not any(owner.get("uid") == owner_uid for owner in owners):
            raise ChildConflictError(
                f"{desired['kind']} {namespace}/{name} exists and is not owned by this pool; "
                "delete or rename it"
            )
        if in_sync(desired, live):
            return "unchanged"
        if kind.replaced_spec_keys == ("*",):
            spec = replacing_patch(live["spec"], desired["spec"])
        else:
            spec = {
                key: replacing_patch(live["spec"].get(key), value)
                if key in kind.replaced_spec_keys
                else value
                for key, value in desired["spec"].items()
            }
        patch = {
            # resourceVersion makes this a compare-and-swap: a concurrent writer gives 409.
            "metadata": {
                **desired["metadata"],
                "resourceVersion": live["metadata"]["resourceVersion"],
            },
            "spec": spec,
        }
        await self.api.merge_patch(path, patch)
        return "patched"

    async def remove_unwanted(
        self, namespace: str, name: str, *, owner_uid: str, wanted: set[tuple[str, str]]
    ) -> list[str]:
        """Delete the pool's optional children that are no longer wanted; their kinds.

        Switching KEDA or the Gateway API InferencePool off must remove the old object: a
        leftover ScaledObject would go on scaling the pool against the built-in scaler. Only an
        object this pool owns is deleted (never one a user made under the same name); a 404, the
        object or its whole API being absent, is nothing to do.
        """
        removed = []
        for api_version, kind in OPTIONAL_CHILDREN:
            if (api_version, kind) in wanted:
                continue
            plural = CHILD_KINDS[(api_version, kind)].plural
            path = object_path(api_version, plural, namespace, name)
            try:
                live = await self.api.get(path)
            except ApiException as error:
                if error.status == 404:
                    continue
                raise
            owners = live["metadata"].get("ownerReferences") or []
            if not any(owner.get("uid") == owner_uid for owner in owners):
                continue
            try:
                await self.api.delete(path, uid=live["metadata"]["uid"])
            except ApiException as error:
                if error.status != 404:  # gone meanwhile: what we wanted
                    raise
            removed.append(kind)
        return removed

    async def _owner_pool_gone(self, desired: dict[str, Any], owner_uid: str) -> bool:
        owners = desired["metadata"].get("ownerReferences") or []
        pool = next(
            (ref for ref in owners if ref.get("uid") == owner_uid and ref.get("kind") == KIND),
            None,
        )
        return pool is not None and not await self.pool_exists(
            desired["metadata"]["namespace"], pool["name"], owner_uid
        )

    async def pool_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the pool with this uid still exists (not deleted, not re-created)."""
        try:
            pool = await self.api.get(object_path(POOL_API_VERSION, PLURAL, namespace, name))
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        metadata = pool["metadata"]
        return bool(metadata.get("uid") == uid and not metadata.get("deletionTimestamp"))

    async def patch_pool_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge ``status`` into the pool's status subresource."""
        path = object_path(POOL_API_VERSION, PLURAL, namespace, name) + "/status"
        await self.api.merge_patch(path, {"status": status})
