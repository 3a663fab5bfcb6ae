"""Kubernetes discovery: a read-only watch of ``inferencepools.slotserve.dev``.

The gateway reads ``spec.model.name``, ``spec.batching``, ``spec.admission`` and
``status.endpoints`` ("IP:PORT" of ready engine pods). The pure part: ``pool_from_inference_pool``,
``choose_owners`` (when several pools claim one model name, the oldest wins, then namespace/name)
and ``PoolCatalog`` (full lists and watch events in, the registry out). The I/O part lists, then
watches from the list's resourceVersion, with the synchronous ``kubernetes`` client in a thread,
and hands both to the event loop. Only addresses found here (or in the pool file) are ever
contacted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from slotserve.gateway.config import Pool, PoolRegistry
from slotserve.pools import AdmissionSpec, BatchingSpec

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "slotserve.dev", "v1alpha1", "inferencepools"
WATCH_TIMEOUT_S = 300  # the server ends each watch after this long; then a full list again
LIST_TIMEOUT_S = 30
CONNECT_TIMEOUT_S = 5
RETRY_S = 2.0


class InvalidPoolObjectError(ValueError):
    """An InferencePool object lacks what the gateway needs."""


def pool_from_inference_pool(obj: dict[str, Any]) -> Pool:
    """Turn an InferencePool object (as the API returns it) into a Pool."""
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    name = (spec.get("model") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise InvalidPoolObjectError("spec.model.name is missing")
    try:
        batching = BatchingSpec.model_validate(spec.get("batching") or {})
        admission = AdmissionSpec.model_validate(spec.get("admission") or {})
    except ValidationError as exc:
        raise InvalidPoolObjectError(f"invalid batching/admission: {exc}") from exc
    endpoints = []
    for address in status.get("endpoints") or []:
        if isinstance(address, str) and address:
            endpoints.append(address if "://" in address else f"http://{address}")
    return Pool(name, tuple(sorted(endpoints)), batching, admission)


@dataclass(frozen=True)
class Claim:
    """One InferencePool's claim on a model name."""

    key: str  # "namespace/name"
    created: str  # metadata.creationTimestamp: RFC 3339 in UTC, so text order is time order
    pool: Pool

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
    return Claim(object_key(obj), created, pool_from_inference_pool(obj))


def rank_claims(claims: Iterable[Claim]) -> dict[str, list[Claim]]:
    """Each model name's claims, its owner first (the oldest object, then namespace/name)."""
    by_model: dict[str, list[Claim]] = {}
    for claim in claims:
        by_model.setdefault(claim.pool.model, []).append(claim)
    return {
        model: sorted(contenders, key=lambda c: c.rank) for model, contenders in by_model.items()
    }


class PoolCatalog:
    """Every InferencePool seen, per watched namespace; the registry is always derived from it.

    A full list replaces what its namespace held (so deletes missed while a watch was down take
    effect at the next list); a watch event replaces or removes one object's claim (so a renamed
    model drops its old name at once). After each change the owners are chosen afresh.
    """

    def __init__(
        self,
        registry: PoolRegistry,
        sources: Iterable[str],
        on_conflict: Callable[[str], None] = lambda model: None,
    ) -> None:
        self.registry = registry
        self.claims: dict[str, dict[str, Claim]] = {source: {} for source in sources}
        self.listed: set[str] = set()
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
        self.listed.add(source)
        self._publish()
        if self.listed == set(self.claims):
            self.registry.mark_synced()

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

    def _publish(self) -> None:
        ranked = rank_claims(claim for claims in self.claims.values() for claim in claims.values())
        self.registry.replace(contenders[0].pool for contenders in ranked.values())
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


def _list_and_watch(namespace: str, catalog: PoolCatalog, loop: asyncio.AbstractEventLoop) -> None:
    """One cycle: a full list, then watch events from its resourceVersion until the server ends
    the watch; the caller loops, so the registry is re-listed every ``WATCH_TIMEOUT_S``."""
    from kubernetes import client, config, watch

    try:
        config.load_incluster_config()
    except config.ConfigException:
        # $KUBECONFIG read now, not when the kubernetes package was imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    api = client.CustomObjectsApi()
    call: Callable[..., Any] = api.list_cluster_custom_object
    args: tuple[str, ...] = (GROUP, VERSION, PLURAL)
    if namespace:
        call, args = api.list_namespaced_custom_object, (GROUP, VERSION, namespace, PLURAL)
    # Every call is bounded: a half-open connection must not freeze discovery for good.
    listing = call(*args, _request_timeout=(CONNECT_TIMEOUT_S, LIST_TIMEOUT_S))
    loop.call_soon_threadsafe(catalog.replace_list, namespace, listing.get("items") or [])
    stream = watch.Watch().stream(
        call,
        *args,
        resource_version=(listing.get("metadata") or {}).get("resourceVersion"),
        timeout_seconds=WATCH_TIMEOUT_S,
        _request_timeout=(CONNECT_TIMEOUT_S, WATCH_TIMEOUT_S + LIST_TIMEOUT_S),
    )
    for event in stream:
        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
            loop.call_soon_threadsafe(
                catalog.apply_event, namespace, event["type"], event["object"]
            )


def start_kubernetes_watch(
    catalog: PoolCatalog, namespaces: list[str], loop: asyncio.AbstractEventLoop
) -> list[threading.Thread]:
    """List and watch InferencePools (one daemon thread per namespace; "" = all namespaces),
    applying lists and events to ``catalog`` on ``loop``."""

    def run(namespace: str) -> None:
        while True:
            try:
                _list_and_watch(namespace, catalog, loop)
            except Exception as exc:  # API errors, 410 Gone, timeouts: list again shortly
                log.warning(
                    "InferencePool list/watch failed (%s); listing again in %g s", exc, RETRY_S
                )
                threading.Event().wait(RETRY_S)

    threads = [
        threading.Thread(target=run, args=(ns,), name=f"ipool-watch-{ns or 'all'}", daemon=True)
        for ns in namespaces
    ]
    for thread in threads:
        thread.start()
    return threads
