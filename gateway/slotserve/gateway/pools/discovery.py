"""Kubernetes discovery: read-only watches of InferencePools and of their Services' EndpointSlices.

From each ``inferencepools.slotserve.dev`` object the gateway reads ``spec.model.name``,
``spec.batching``, ``spec.admission`` and ``status.coldStartSeconds`` (the Retry-After of requests
held while no engine is up); the engines to route to come from the EndpointSlices of
the pool's Service (same name and namespace), so only pods that the Service selects and that are
ready get traffic. ``status.endpoints`` is information for people and is never routed to: anyone
allowed to patch ``inferencepools/status`` could otherwise steer prompts anywhere.

Who may own a model name: only a pool the operator has not refused (a ``Degraded`` condition whose
reason ends in ``NotAllowed``: an image, env, host path... its policy forbids), and, with
``model_namespaces`` set, only a pool in a namespace allowed for that name (so a tenant cannot
claim a name the platform has not deployed yet and receive its prompts once it does). Pools that
may not own their name are ignored, with a warning.

The pure part: ``pool_from_inference_pool``, ``rank_claims`` (when several pools claim one model
name, the oldest wins, then namespace/name) and ``PoolCatalog`` (full lists and watch events of
both kinds in, the registry out). The I/O part lists, then watches from the list's
resourceVersion, with the synchronous ``kubernetes`` client in threads, and hands both to the
event loop. Only addresses found here (or in the pool file) are ever contacted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from slotserve.contracts.crd import GROUP, PLURAL, VERSION
from slotserve.contracts.pool_spec import AdmissionSpec, BatchingSpec, RoutingSpec
from slotserve.gateway.pools.config import Pool, PoolRegistry
from slotserve.gateway.pools.endpointslices import SLICE_SELECTOR, EndpointIndex

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300  # the server ends each watch after this long; then a full list again
LIST_TIMEOUT_S = 30
CONNECT_TIMEOUT_S = 5
RETRY_S = 2.0
USER_AGENT = "slotserve-gateway"  # tells the gateway's API calls apart in audit logs and tests
# Everything the gateway asks of the API server; the chart grants exactly these (a chart test
# compares them) and the discovery tests check every call the gateway makes against them.
REQUIRED_RULES: list[dict[str, list[str]]] = [
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["list", "watch"],
    },
]
POOLS, SLICES = PLURAL, "endpointslices"


class InvalidPoolObjectError(ValueError):
    """An InferencePool object lacks what the gateway needs."""


def pool_from_inference_pool(obj: dict[str, Any]) -> Pool:
    """Turn an InferencePool object (as the API returns it) into a Pool, without endpoints:
    those come from its Service's EndpointSlices, never from the object's status."""
    spec = obj.get("spec") or {}
    name = (spec.get("model") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise InvalidPoolObjectError("spec.model.name is missing")
    try:
        batching = BatchingSpec.model_validate(spec.get("batching") or {})
        admission = AdmissionSpec.model_validate(spec.get("admission") or {})
        routing = RoutingSpec.model_validate(spec.get("routing") or {})
    except ValidationError as exc:
        raise InvalidPoolObjectError(f"invalid batching/admission/routing: {exc}") from exc
    return Pool(name, (), batching, admission, cold_start_seconds(obj), routing)


def cold_start_seconds(obj: dict[str, Any]) -> float | None:
    """The pool's measured cold start (``status.coldStartSeconds``, the operator's): only the
    Retry-After of requests held while no engine is up, so a bad value is ignored, not fatal."""
    value = (obj.get("status") or {}).get("coldStartSeconds")
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86_400:
        return None
    return float(value)


def refusal(obj: dict[str, Any]) -> str:
    """The operator's refusal of this pool (its Degraded reason, e.g. ``ImageNotAllowed``), or
    "" when it has not refused it. Only policy refusals count: a pod that crashes or cannot be
    scheduled is trouble, not a refusal, and must not move a model name between pools."""
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if not isinstance(condition, dict) or condition.get("type") != "Degraded":
            continue
        reason = condition.get("reason")
        if condition.get("status") == "True" and isinstance(reason, str):
            return reason if reason.endswith("NotAllowed") else ""
    return ""


ModelNamespaces = tuple[tuple[str, frozenset[str]], ...]  # (model name glob, namespaces)


def namespace_allowed(model: str, namespace: str, allowed: ModelNamespaces) -> bool:
    """Whether a pool in ``namespace`` may serve ``model``: the first entry whose glob matches
    the name decides; a name no entry matches may be served from any namespace."""
    for pattern, namespaces in allowed:
        if fnmatch.fnmatchcase(model, pattern):
            return namespace in namespaces
    return True


@dataclass(frozen=True)
class Claim:
    """One InferencePool's claim on a model name."""

    key: str  # "namespace/name"
    created: str  # metadata.creationTimestamp: RFC 3339 in UTC, so text order is time order
    pool: Pool
    refused: str = ""  # the operator's refusal reason ("": accepted)

    @property
    def namespace(self) -> str:
        return self.key.partition("/")[0]

    @property
    def rank(self) -> tuple[str, str]:
        """Lower wins the model name: the oldest object, then namespace/name. Both come from
        the object itself, so every replica, before and after any restart, picks the same."""
        return (self.created, self.key)


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def claim_from(obj: dict[str, Any]) -> Claim:
    meta = obj.get("metadata") or {}
    created = meta.get("creationTimestamp")
    if not isinstance(created, str) or not created:
        raise InvalidPoolObjectError("metadata.creationTimestamp is missing")
    return Claim(object_key(obj), created, pool_from_inference_pool(obj), refusal(obj))


def rank_claims(claims: Iterable[Claim]) -> dict[str, list[Claim]]:
    """Each model name's claims, its owner first (the oldest object, then namespace/name)."""
    by_model: dict[str, list[Claim]] = {}
    for claim in claims:
        by_model.setdefault(claim.pool.model, []).append(claim)
    return {
        model: sorted(contenders, key=lambda c: c.rank) for model, contenders in by_model.items()
    }


class PoolCatalog:
    """Every InferencePool and EndpointSlice seen, per watched namespace; the registry is always
    derived from them.

    A full list replaces what its namespace held (so deletes missed while a watch was down take
    effect at the next list); a watch event replaces or removes one object (so a renamed model
    drops its old name at once, an endpoint that turns unready leaves at once). After each change
    the owners are chosen afresh and each owner gets its Service's ready endpoints.
    """

    def __init__(
        self,
        registry: PoolRegistry,
        sources: Iterable[str],
        on_conflict: Callable[[str], None] = lambda model: None,
        model_namespaces: ModelNamespaces = (),
    ) -> None:
        self.registry = registry
        self.model_namespaces = model_namespaces
        self._ignored: set[tuple[str, str]] = set()  # (key, why) already logged
        self.claims: dict[str, dict[str, Claim]] = {source: {} for source in sources}
        self.endpoints = EndpointIndex()
        self.listed: set[tuple[str, str]] = set()  # (POOLS or SLICES, source) listed once
        self.on_conflict = on_conflict
        self._reported: set[tuple[str, str]] = set()  # (model, losing key) already counted

    def replace_list(self, source: str, objects: Iterable[dict[str, Any]]) -> None:
        claims = {}
        for obj in objects:
            try:
                claims[object_key(obj)] = claim_from(obj)
            except InvalidPoolObjectError as exc:
                log.warning("ignoring InferencePool %s: %s", object_key(obj), exc)
        self.claims[source] = claims
        self._listed(POOLS, source)

    def apply_event(self, source: str, event_type: str, obj: dict[str, Any]) -> None:
        claims = self.claims.setdefault(source, {})
        key = object_key(obj)
        claims.pop(key, None)  # a renamed model leaves its old name here
        if event_type in ("ADDED", "MODIFIED"):
            try:
                claims[key] = claim_from(obj)
            except InvalidPoolObjectError as exc:
                log.warning("ignoring InferencePool %s: %s", key, exc)
        self._publish()

    def replace_slices(self, source: str, objects: Iterable[dict[str, Any]]) -> None:
        self.endpoints.replace_list(source, objects)
        self._listed(SLICES, source)

    def apply_slice_event(self, source: str, event_type: str, obj: dict[str, Any]) -> None:
        self.endpoints.apply_event(source, event_type, obj)
        self._publish()

    def _listed(self, kind: str, source: str) -> None:
        self.listed.add((kind, source))
        self._publish()
        # Ready only once both are in everywhere: pools without their endpoints would be 503s.
        everything = {(each, namespace) for each in (POOLS, SLICES) for namespace in self.claims}
        if self.listed >= everything:
            self.registry.mark_synced()

    def _may_own(self, claim: Claim) -> bool:
        model = claim.pool.model
        why = ""
        if claim.refused:
            why = f"the operator refused it ({claim.refused})"
        elif not namespace_allowed(model, claim.namespace, self.model_namespaces):
            why = f"namespace {claim.namespace!r} may not serve model {model!r} (model_namespaces)"
        if why and (claim.key, why) not in self._ignored:
            self._ignored.add((claim.key, why))
            log.warning("InferencePool %s is ignored: %s", claim.key, why)
        return not why

    def _publish(self) -> None:
        claims = (claim for claims in self.claims.values() for claim in claims.values())
        ranked = rank_claims(claim for claim in claims if self._may_own(claim))
        # The pool's Service has the pool's own name and namespace (slotserve/operator/builders.py).
        self.registry.replace(
            dataclasses.replace(owner.pool, endpoints=self.endpoints.endpoints_for(owner.key))
            for owner, *_ in ranked.values()
        )
        current = set()
        for model, (owner, *losers) in sorted(ranked.items()):
            for loser in losers:
                current.add((model, loser.key))
                if (model, loser.key) not in self._reported:
                    log.warning(
                        "InferencePool %s also serves model %r: ignored, %s (the oldest) serves it",
                        loser.key,
                        model,
                        owner.key,
                    )
                    self.on_conflict(model)
        self._reported = current


# -- I/O: list, then watch, each collection in each namespace ------------------------------------

Calls = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _api_client() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        # $KUBECONFIG read now, not when the kubernetes package was imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    api_client = client.ApiClient()
    api_client.user_agent = USER_AGENT
    return api_client


def _pool_calls(api_client: Any, namespace: str) -> Calls:
    from kubernetes import client

    api = client.CustomObjectsApi(api_client)
    if namespace:
        return api.list_namespaced_custom_object, (GROUP, VERSION, namespace, PLURAL), {}
    return api.list_cluster_custom_object, (GROUP, VERSION, PLURAL), {}


def _slice_calls(api_client: Any, namespace: str) -> Calls:
    from kubernetes import client

    api = client.DiscoveryV1Api(api_client)
    selector = {"label_selector": SLICE_SELECTOR}
    if namespace:
        return api.list_namespaced_endpoint_slice, (namespace,), selector
    return api.list_endpoint_slice_for_all_namespaces, (), selector


def _list_and_watch(
    calls: Callable[[Any, str], Calls],
    namespace: str,
    on_list: Callable[[str, list[dict[str, Any]]], None],
    on_event: Callable[[str, str, dict[str, Any]], None],
    loop: asyncio.AbstractEventLoop,
) -> None:
    """One cycle: a full list, then watch events from its resourceVersion until the server ends
    the watch; the caller loops, so the registry is re-listed every ``WATCH_TIMEOUT_S``.

    Objects stay plain JSON as the API sends them (``_preload_content=False``; the watch's
    return type ``object``): one parser for pools and slices, and no reliance on typed models
    (older clients refuse a slice whose ``endpoints`` is null, as a Service without pods has).
    ERROR events (410 Gone) still raise, so the caller lists again.
    """
    from kubernetes import watch

    call, args, kwargs = calls(_api_client(), namespace)
    # Every call is bounded: a half-open connection must not freeze discovery for good.
    response = call(
        *args,
        **kwargs,
        _preload_content=False,
        _request_timeout=(CONNECT_TIMEOUT_S, LIST_TIMEOUT_S),
    )
    listing = json.loads(response.data)
    loop.call_soon_threadsafe(on_list, namespace, listing.get("items") or [])
    stream = watch.Watch(return_type="object").stream(
        call,
        *args,
        **kwargs,
        resource_version=(listing.get("metadata") or {}).get("resourceVersion"),
        timeout_seconds=WATCH_TIMEOUT_S,
        _request_timeout=(CONNECT_TIMEOUT_S, WATCH_TIMEOUT_S + LIST_TIMEOUT_S),
    )
    for event in stream:
        if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
            loop.call_soon_threadsafe(on_event, namespace, event["type"], event["object"])


def start_kubernetes_watch(
    catalog: PoolCatalog, namespaces: list[str], loop: asyncio.AbstractEventLoop
) -> list[threading.Thread]:
    """List and watch InferencePools and EndpointSlices (two daemon threads per namespace;
    "" = all namespaces), applying lists and events to ``catalog`` on ``loop``."""

    def run(kind: str, namespace: str) -> None:
        calls, on_list, on_event = (
            (_pool_calls, catalog.replace_list, catalog.apply_event)
            if kind == POOLS
            else (_slice_calls, catalog.replace_slices, catalog.apply_slice_event)
        )
        while True:
            try:
                _list_and_watch(calls, namespace, on_list, on_event, loop)
            except Exception as exc:  # API errors, 410 Gone, timeouts: list again shortly
                log.warning("%s list/watch failed (%r); listing again in %g s", kind, exc, RETRY_S)
                threading.Event().wait(RETRY_S)

    threads = [
        threading.Thread(
            target=run, args=(kind, ns), name=f"{kind}-watch-{ns or 'all'}", daemon=True
        )
        for ns in namespaces
        for kind in (POOLS, SLICES)
    ]
    for thread in threads:
        thread.start()
    return threads
