"""The operator's handlers for what it reads from the gateways' Redis: status.admission (with
the Saturated condition and its events) and the built-in autoscaler, which writes the pool's
scale subresource as an HPA would (``kubectl scale`` is then overridden by it: documented).

A mixin of ``PoolOperator``: it uses the operator's indexes, status writer and handler context
(kopf posts events only from a handler's context). The decisions are pure
(``admission``, ``autoscaler``); this is the glue.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from slotserve.operator.admission import AdmissionReading, Saturation
from slotserve.operator.admission_monitor import Target
from slotserve.operator.autoscaler import ScalePolicy, Stabilizer, demand_of, recommend
from slotserve.operator.settings import OperatorSettings
from slotserve.operator.views import Key, PoolView, StatusWriter, all_views, first

log = logging.getLogger(__name__)
REWRITE_AFTER_S = 5.0
NAME_CONFLICT = "ModelNameConflict"


class AutoscalingHandlers:
    """status.admission and the built-in autoscaler (mixed into ``PoolOperator``)."""

    settings: OperatorSettings
    _indexes: dict[str, Any]
    _handler_context: contextvars.Context | None
    _writer: StatusWriter | None
    _stabilizers: dict[Key, Stabilizer]
    _scaled_to: dict[Key, tuple[int, float]]  # the last write and when: not repeated at once

    @property
    def writer(self) -> StatusWriter:
        raise NotImplementedError

    def _refresh(self, key: Key, observed_generation: int | None = None) -> None:
        raise NotImplementedError

    # --- status.admission -------------------------------------------------------------------

    def _admission_targets(self) -> list[Target]:
        """Valid pools that own their model name: the ones whose Redis queue is theirs (a pool
        refused for other reasons still has the gateways' queue, so it is observed)."""
        if not self._indexes or self._writer is None:
            return []
        targets = []
        for view in all_views(self._indexes["pool_index"]):
            key = (view.owner["metadata"]["namespace"], view.owner["metadata"]["name"])
            problem = self.writer.problems.get(key)
            if view.pool is None or (problem is not None and problem.reason == NAME_CONFLICT):
                continue
            pods = self._indexes["pod_index"].get(key, [])
            num_ready = sum(1 for pod in pods if pod.serving) if view.desired_replicas else 0
            slots = num_ready * view.pool.spec.batching.max_batch_size
            targets.append(Target(key, view.pool.spec.model.name, slots))
        return targets

    def _publish_admission(
        self,
        target: Target,
        admission: dict[str, Any] | None,
        saturation: Saturation,
        previous: Saturation | None,
    ) -> None:
        """Write the admission status (thread; in a handler's context for kopf's events)."""
        if self._handler_context is not None:
            self._handler_context.run(
                self._publish_admission_in_context, target, admission, saturation, previous
            )

    def _publish_admission_in_context(
        self,
        target: Target,
        admission: dict[str, Any] | None,
        saturation: Saturation,
        previous: Saturation | None,
    ) -> None:
        if admission is not None:
            self.writer.admission[target.key] = admission
        self.writer.saturation[target.key] = saturation
        self._refresh(target.key)
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

    async def _autoscale(self, target: Target, reading: AdmissionReading | None) -> None:
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
        if self._handler_context is None:
            return
        try:
            await asyncio.to_thread(self._handler_context.run, self._scale, view, desired, message)
        except ApiException as error:  # retried on the next reading
            log.warning("scaling %s/%s failed: %s", *target.key, error.reason)
            return
        self._scaled_to[target.key] = (desired, now_s)

    def _scale(self, view: PoolView, replicas: int, message: str) -> None:
        metadata = view.owner["metadata"]
        self.writer.children.scale_pool(metadata["namespace"], metadata["name"], replicas)
        log.info("pool %s/%s: %s", metadata["namespace"], metadata["name"], message)
        kopf.event(view.owner, type="Normal", reason="Scaled", message=message)
