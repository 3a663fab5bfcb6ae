"""The operator's handlers for what it reads from the gateways' Redis: status.admission (with
the Saturated condition and its events) and the built-in autoscaler, which writes the pool's
scale subresource as an HPA would (``kubectl scale`` is then overridden by it: documented).

A component the operator builds at start-up from what it uses, passed in: the operator's kopf
indexes, its status writer and status refresh, and a handler's context (kopf posts events only
from one). The decisions are pure (``admission``, ``autoscaler``); this is the glue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from slotserve.operator.admission import AdmissionReading, Saturation
from slotserve.operator.admission_monitor import Target
from slotserve.operator.autoscaler import ScalePolicy, Stabilizer, demand_of, recommend
from slotserve.operator.handler_context import HandlerContext
from slotserve.operator.status_writer import StatusWriter
from slotserve.operator.views import Key, PoolView, all_views, first

log = logging.getLogger(__name__)
REWRITE_AFTER_S = 5.0
NAME_CONFLICT = "ModelNameConflict"


class Autoscaling:
    """status.admission and the built-in autoscaler: the admission monitor's three callbacks
    (``targets``, ``publish``, ``autoscale``)."""

    def __init__(
        self,
        *,
        indexes: Mapping[str, Any],
        writer: StatusWriter,
        refresh: Callable[[Key], Awaitable[None]],
        handler_context: HandlerContext,
    ) -> None:
        # The operator's kopf indexes by id: empty until its first handler has run, then filled
        # in place (kopf hands every handler the same index objects).
        self._indexes = indexes
        self.writer = writer
        self._refresh = refresh
        self._handler_context = handler_context
        self._stabilizers: dict[Key, Stabilizer] = {}
        # The last write per pool and when: not repeated at once.
        self._scaled_to: dict[Key, tuple[int, float]] = {}

    # --- status.admission -------------------------------------------------------------------

    def targets(self) -> list[Target]:
        """Valid pools that own their model name: the ones whose Redis queue is theirs (a pool
        refused for other reasons still has the gateways' queue, so it is observed)."""
        if not self._indexes:
            return []
        targets = []
        for view in all_views(self._indexes["pool_index"]):
            key = view.key
            problem = self.writer.problems.get(key)
            if view.pool is None or (problem is not None and problem.reason == NAME_CONFLICT):
                continue
            pods = self._indexes["pod_index"].get(key, [])
            num_ready = sum(1 for pod in pods if pod.serving) if view.desired_replicas else 0
            slots = num_ready * view.pool.spec.batching.max_batch_size
            targets.append(Target(key, view.pool.spec.model.name, slots))
        return targets

    async def publish(
        self,
        target: Target,
        admission: dict[str, Any] | None,
        saturation: Saturation,
        previous: Saturation | None,
    ) -> None:
        """Write the admission status (in a handler's context, for kopf's events)."""
        if self._handler_context.can_post_events:
            await self._handler_context.run(
                self._publish_in_context(target, admission, saturation, previous)
            )

    async def _publish_in_context(
        self,
        target: Target,
        admission: dict[str, Any] | None,
        saturation: Saturation,
        previous: Saturation | None,
    ) -> None:
        if admission is not None:
            self.writer.admission[target.key] = admission
        self.writer.saturation[target.key] = saturation
        await self._refresh(target.key)
        view: PoolView | None = first(self._indexes["pool_index"], target.key)
        before = previous.status if previous is not None else "False"
        if view is None or before == saturation.status:
            return
        if saturation.status == "True":
            kopf.warn(view.owner, reason="Saturated", message=saturation.message)
        elif saturation.status == "Unknown":
            kopf.warn(view.owner, reason=saturation.reason, message=saturation.message)
        elif before == "True":
            # kopf.info would be filtered by posting.level (WARNING keeps log noise out).
            kopf.event(view.owner, type="Normal", reason="Unsaturated", message=saturation.message)

    # --- the built-in autoscaler ------------------------------------------------------------

    async def autoscale(self, target: Target, reading: AdmissionReading | None) -> None:
        """One reading of one pool: scale it if its demand and windows say so."""
        view: PoolView | None = first(self._indexes["pool_index"], target.key)
        autoscaling = view.pool.spec.autoscaling if view and view.pool else None
        if view is None or view.pool is None or autoscaling is None:
            self._stabilizers.pop(target.key, None)
            return
        if autoscaling.provider != "builtin" or reading is None:
            return  # KEDA scales it; or Redis is unreadable: hold the replicas as they are
        if target.key in self.writer.problems:
            return  # refused (e.g. another HPA scales it): the operator changes nothing
        policy = ScalePolicy.from_spec(autoscaling, view.pool.spec.batching.max_batch_size)
        demand = demand_of(reading)
        stabilizer = self._stabilizers.setdefault(target.key, Stabilizer())
        current, now_s = view.desired_replicas, time.monotonic()
        desired = stabilizer.desired(now_s, recommend(demand, policy), current, policy)
        # Until the pool's watch event brings the new replicas, the index shows the old ones.
        written, written_at = self._scaled_to.get(target.key, (-1, 0.0))
        if desired == current or (desired == written and now_s - written_at < REWRITE_AFTER_S):
            return
        message = (
            f"{current} -> {desired} replicas: {demand} requests queued or in flight, "
            f"target {policy.target} per replica"
        )
        if not self._handler_context.can_post_events:
            return
        try:
            await self._handler_context.run(self._scale(view, desired, message))
        except ApiException as error:  # retried on the next reading
            log.warning("scaling %s/%s failed: %s", *target.key, error.reason)
            return
        self._scaled_to[target.key] = (desired, now_s)

    async def _scale(self, view: PoolView, replicas: int, message: str) -> None:
        namespace, name = view.key
        await self.writer.children.scale_pool(namespace, name, replicas)
        log.info("pool %s/%s: %s", namespace, name, message)
        kopf.event(view.owner, type="Normal", reason="Scaled", message=message)
