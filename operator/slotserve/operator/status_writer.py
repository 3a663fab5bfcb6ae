"""The status writer: a pool's status recomputed from the kopf indexes, patched when it changed.

``status.compute_status`` decides what the status is; ``StatusWriter`` adds what the operator
learnt itself (problems found while reconciling, the admission monitor's readings) and writes it
with one merge patch, only when something moved.
"""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from slotserve.operator import kube
from slotserve.operator.admission import Saturation, saturated_condition
from slotserve.operator.cold_start import ColdStarts
from slotserve.operator.status import DeploymentView, PodView, Problem, compute_status
from slotserve.operator.views import Key, PoolView, first


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Written:
    uid: str
    status: dict[str, Any]


@dataclass
class StatusWriter:
    """Writes pool status, once per change, one write per pool at a time."""

    children: kube.Children
    problems: dict[Key, Problem] = field(default_factory=dict)
    # Published by the admission monitor; written with the rest of the status.
    admission: dict[Key, dict[str, Any]] = field(default_factory=dict)
    saturation: dict[Key, Saturation] = field(default_factory=dict)
    cold_starts: ColdStarts = field(default_factory=ColdStarts)
    num_status_writes: int = 0
    _written: dict[Key, _Written] = field(default_factory=dict)
    # A refresh awaits its patch: a second refresh of the same pool waits, so that an older
    # status is never written after a newer one.
    _locks: dict[Key, asyncio.Lock] = field(default_factory=dict)

    async def refresh(
        self,
        key: Key,
        *,
        pool_index: kopf.Index[Key, PoolView],
        pod_index: kopf.Index[Key, PodView],
        deployment_index: kopf.Index[Key, DeploymentView],
        observed_generation: int | None = None,
    ) -> None:
        """Recompute the status of pool ``key`` from the indexes; patch it if it changed."""
        async with self._locks.setdefault(key, asyncio.Lock()):
            view: PoolView | None = first(pool_index, key)
            if view is None:  # deleted: nothing to write to
                self.forget(key)
                return
            written = self._written.get(key)
            previous = written.status if written and written.uid == view.uid else view.status
            status = compute_status(
                pool_name=key[1],
                desired_replicas=view.desired_replicas,
                deployment=first(deployment_index, key),
                pods=pod_index.get(key, []),
                problem=view.problem or self.problems.get(key),
                previous_conditions=previous.get("conditions") or [],
                now=_now(),
            )
            if observed_generation is not None:
                status["observedGeneration"] = observed_generation
            cold_start_s = self.cold_starts.observe(
                key,
                ((pod.name, pod.ready_after_s) for pod in pod_index.get(key, [])),
                previous.get("coldStartSeconds"),
            )
            if cold_start_s is not None:
                status["coldStartSeconds"] = cold_start_s
            saturation = self.saturation.get(key)
            if saturation is not None:
                before = {c.get("type"): c for c in previous.get("conditions") or []}
                status["conditions"].append(
                    saturated_condition(saturation, before.get("Saturated"), _now())
                )
            admission = self.admission.get(key)
            if admission is not None:
                status["admission"] = admission
            if kube.is_subset(status, previous) and (
                admission is None or previous.get("admission") == admission
            ):
                return
            patch = dict(status)
            if admission is not None:  # reasons no longer seen are removed, not merged
                patch["admission"] = kube.replacing_patch(previous.get("admission"), admission)
            try:
                await self.children.patch_pool_status(key[0], key[1], patch)
                self.num_status_writes += 1
            except ApiException as error:
                if error.status == 404:  # deleted meanwhile
                    self.forget(key)
                    return
                raise
            self._written[key] = _Written(view.uid, {**previous, **status})

    def forget(self, key: Key) -> None:
        self._written.pop(key, None)
        self.problems.pop(key, None)
        self.admission.pop(key, None)
        self.saturation.pop(key, None)
        self.cold_starts.forget(key)
