"""Kubernetes discovery: a read-only watch of ``inferencepools.slotserve.dev``.

The gateway reads ``spec.model.name``, ``spec.batching``, ``spec.admission`` and
``status.endpoints`` ("IP:PORT" of ready engine pods). ``pool_from_inference_pool`` is the pure
part; the watch runs the synchronous ``kubernetes`` client in a thread and hands events to the
event loop. Only addresses found here (or in the pool file) are ever contacted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import ValidationError

from slotserve.gateway.config import Pool, PoolRegistry
from slotserve.pools import AdmissionSpec, BatchingSpec

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "slotserve.dev", "v1alpha1", "inferencepools"


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


def apply_event(
    registry: PoolRegistry, owners: dict[str, str], event_type: str, obj: dict[str, Any]
) -> None:
    """Apply one watch event; ``owners`` maps model name -> "namespace/name" of its object."""
    meta = obj.get("metadata") or {}
    key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    if event_type == "DELETED":
        for model, owner in list(owners.items()):
            if owner == key:
                del owners[model]
                registry.remove(model)
        return
    try:
        pool = pool_from_inference_pool(obj)
    except InvalidPoolObjectError as exc:
        log.warning("ignoring InferencePool %s: %s", key, exc)
        return
    if owners.get(pool.model, key) != key:
        log.warning("InferencePool %s serves %r, already served by %s", key, pool.model, owners)
        return
    owners[pool.model] = key
    registry.upsert(pool)


def _stream_events(namespace: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Watch events of one namespace ("" = all), re-listing after each server timeout."""
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
    while True:
        for event in watch.Watch().stream(call, *args, timeout_seconds=300):
            yield event["type"], event["object"]


def start_kubernetes_watch(
    registry: PoolRegistry, namespaces: list[str], loop: asyncio.AbstractEventLoop
) -> list[threading.Thread]:
    """Watch InferencePools (one daemon thread per namespace), applying events on ``loop``."""
    owners: dict[str, str] = {}

    def run(namespace: str) -> None:
        while True:
            try:
                for event_type, obj in _stream_events(namespace):
                    loop.call_soon_threadsafe(apply_event, registry, owners, event_type, obj)
            except Exception:
                log.exception("InferencePool watch failed; retrying in 5 s")
                threading.Event().wait(5)

    threads = [
        threading.Thread(target=run, args=(ns,), name=f"ipool-watch-{ns or 'all'}", daemon=True)
        for ns in (namespaces or [""])
    ]
    for thread in threads:
        thread.start()
    return threads
