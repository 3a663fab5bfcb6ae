"""The thin I/O layer: Kubernetes client configuration and create-or-patch of owned children.

Objects travel as plain dicts (``_preload_content=False``), exactly as the builders make them
and as the API returns them, so comparisons need no model round trips.

Children are written with JSON merge patches (not server-side apply): read, compare, and patch
only when something differs, with the read's resourceVersion as a compare-and-swap. The pod
template is owned whole, so keys the pool no longer sets are nulled out of it. This works the
same on every API server, including the emulator the tests use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import kopf
import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

from slotserve.operator.drift import in_sync, is_subset
from slotserve.operator.models import GROUP, KIND, PLURAL, VERSION

__all__ = ["ChildConflictError", "Children", "in_sync", "is_subset", "replacing_patch"]

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "slotserve-operator"
Outcome = Literal["created", "patched", "unchanged"]
# Children that are custom resources of other projects: (apiVersion, kind) -> (group, version,
# plural). Keyed by apiVersion too: the Gateway API's InferencePool shares our kind name.
CUSTOM_CHILDREN: dict[tuple[str, str], tuple[str, str, str]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): ("keda.sh", "v1alpha1", "scaledobjects"),
    ("inference.networking.k8s.io/v1", "InferencePool"): (
        "inference.networking.k8s.io",
        "v1",
        "inferencepools",
    ),
}


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
class _Kind:
    read: Callable[..., Any]
    create: Callable[..., Any]
    patch: Callable[..., Any]
    # Parts of spec that we own whole (removals must propagate); the rest is merged.
    # "*" = the whole spec: keys only the live object has are removed too.
    replaced_spec_keys: tuple[str, ...]


class Children:
    """Create-or-patch of a pool's children, and status writes of pools."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        apps = kubernetes.client.AppsV1Api(api_client)
        core = kubernetes.client.CoreV1Api(api_client)
        networking = kubernetes.client.NetworkingV1Api(api_client)
        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self._kinds = {
            "Deployment": _Kind(
                apps.read_namespaced_deployment,
                apps.create_namespaced_deployment,
                apps.patch_namespaced_deployment,
                ("template",),
            ),
            "Service": _Kind(
                core.read_namespaced_service,
                core.create_namespaced_service,
                core.patch_namespaced_service,
                ("selector",),
            ),
            "NetworkPolicy": _Kind(
                networking.read_namespaced_network_policy,
                networking.create_namespaced_network_policy,
                networking.patch_namespaced_network_policy,
                ("*",),
            ),
        }
        self._custom_kinds = {
            key: self._custom_kind(*resource) for key, resource in CUSTOM_CHILDREN.items()
        }
        self._extensions = kubernetes.client.ApiextensionsV1Api(api_client)
        self._autoscaling = kubernetes.client.AutoscalingV2Api(api_client)

    def _custom_kind(self, group: str, version: str, plural: str) -> _Kind:
        custom = self._custom
        return _Kind(
            lambda name, ns, **kw: custom.get_namespaced_custom_object(
                group, version, ns, plural, name, **kw
            ),
            lambda ns, body, **kw: custom.create_namespaced_custom_object(
                group, version, ns, plural, body, **kw
            ),
            lambda name, ns, body, **kw: custom.patch_namespaced_custom_object(
                group, version, ns, plural, name, body, **kw
            ),
            ("*",),
        )

    def crd_exists(self, name: str) -> bool:
        """Whether the CustomResourceDefinition ``name`` is installed (e.g. KEDA's)."""
        try:
            self._extensions.read_custom_resource_definition(name, _preload_content=False)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def autoscalers_of_pool(self, namespace: str, name: str) -> list[str]:
        """Names of the HorizontalPodAutoscalers whose target is the pool."""
        listed = _json(
            self._autoscaling.list_namespaced_horizontal_pod_autoscaler(
                namespace, _preload_content=False
            )
        )
        return [
            hpa["metadata"]["name"]
            for hpa in listed.get("items") or []
            if (ref := (hpa.get("spec") or {}).get("scaleTargetRef") or {}).get("kind") == KIND
            and ref.get("name") == name
            and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/")
        ]

    def scale_pool(self, namespace: str, name: str, replicas: int) -> None:
        """Set the pool's replicas through its scale subresource (what an HPA does)."""
        self._custom.patch_namespaced_custom_object_scale(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"spec": {"replicas": replicas}},
            _content_type=MERGE_PATCH,
            _preload_content=False,
        )

    def apply(self, desired: dict[str, Any], *, owner_uid: str) -> Outcome:
        """Create ``desired`` or patch the live object towards it; raises ChildConflictError."""
        kind = (
            self._custom_kinds.get((desired["apiVersion"], desired["kind"]))
            or self._kinds[desired["kind"]]
        )
        name, namespace = desired["metadata"]["name"], desired["metadata"]["namespace"]
        try:
            live = _json(kind.read(name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status != 404:
                raise
            if self._owner_pool_gone(desired, owner_uid):
                # A converge that began before its pool was deleted must not re-create children
                # the garbage collector has just removed (they would dangle until GC runs again).
                return "unchanged"
            kind.create(namespace, desired, _preload_content=False)
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
        kind.patch(name, namespace, patch, _content_type=MERGE_PATCH, _preload_content=False)
        return "patched"

    def _owner_pool_gone(self, desired: dict[str, Any], owner_uid: str) -> bool:
        owners = desired["metadata"].get("ownerReferences") or []
        pool = next(
            (ref for ref in owners if ref.get("uid") == owner_uid and ref.get("kind") == KIND),
            None,
        )
        return pool is not None and not self.pool_exists(
            desired["metadata"]["namespace"], pool["name"], owner_uid
        )

    def pool_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the pool with this uid still exists (not deleted, not re-created)."""
        try:
            response = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        metadata = _json(response)["metadata"]
        return bool(metadata.get("uid") == uid and not metadata.get("deletionTimestamp"))

    def patch_pool_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge ``status`` into the pool's status subresource."""
        self._custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"status": status},
            _content_type=MERGE_PATCH,
            _preload_content=False,
        )


def _json(response: Any) -> dict[str, Any]:
    return dict(json.loads(response.data))
