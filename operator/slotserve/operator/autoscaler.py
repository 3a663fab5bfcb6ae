"""The built-in autoscaler, pure: desired replicas from the admission queue, stabilised in time.

Target: **queued + in-flight requests per replica** (``targetRequestsPerReplica``, default the
pool's ``maxBatchSize``, i.e. its slots), as KubeAI and KEDA's HTTP add-on do. Slot utilisation
(in-flight / slots) was the other candidate; it was not chosen because it saturates at 100%: a
pool with 1 request waiting and one with 1,000 waiting read the same, so it can only step up one
guess at a time, and at zero replicas it is 0/0. Demand in requests is defined at zero replicas
and grows with the backlog, so ``ceil(demand / target)`` jumps to the needed size in one step.

At zero ready engines the gateway holds requests in the shared queue while an engine starts
(``gateway/cold_start.py``), so the first request is queued demand at the next reading, with no
metrics window to wait for. With holding off it refuses them at once (503
``no_ready_endpoint``); such refusals in the last 10-20 s count as a demand of one, so the first
request still wakes the pool.

Windows work as Kubernetes' HPA stabilisation does: scale up to the *lowest* recommendation of
the last ``scaleUpWindowSeconds`` (0 = at once), scale down to the *highest* of the last
``scaleDownWindowSeconds``, so one quiet reading never drops capacity that the next burst needs.
Waking from zero is the exception: with requests held for the first engine, 0 -> 1 is at once
and only the rest waits for the up window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from slotserve.operator.admission import AdmissionReading
from slotserve.operator.models import AutoscalingSpec


@dataclass(frozen=True)
class ScalePolicy:
    min_replicas: int
    max_replicas: int
    target: int
    up_window_s: float
    down_window_s: float

    @classmethod
    def from_spec(cls, spec: AutoscalingSpec, max_batch_size: int) -> ScalePolicy:
        return cls(
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            target=spec.target_requests_per_replica or max_batch_size,
            up_window_s=spec.scale_up_window_seconds,
            down_window_s=spec.scale_down_window_seconds,
        )


def demand_of(reading: AdmissionReading) -> int:
    """Requests that want an engine now: waiting + running (+1 if refused for lack of one)."""
    refused = reading.window.recent_rejected.get("no_ready_endpoint", 0) > 0
    return reading.queued + reading.in_flight + (1 if refused else 0)


def recommend(demand: int, policy: ScalePolicy) -> int:
    """Replicas for ``demand`` alone, within the bounds."""
    wanted = -(-demand // policy.target)  # ceil
    return max(policy.min_replicas, min(policy.max_replicas, wanted))


@dataclass
class Stabilizer:
    """One pool's recent recommendations; ``desired`` applies the windows."""

    history: deque[tuple[float, int]] = field(default_factory=deque)

    def desired(self, now_s: float, recommendation: int, current: int, policy: ScalePolicy) -> int:
        self.history.append((now_s, recommendation))
        horizon = max(policy.up_window_s, policy.down_window_s)
        while self.history and self.history[0][0] < now_s - horizon:
            self.history.popleft()

        def within(window_s: float) -> list[int]:
            return [r for t, r in self.history if t >= now_s - window_s]

        bounded = max(policy.min_replicas, min(policy.max_replicas, current))
        if recommendation > current:
            stable = max(bounded, min(within(policy.up_window_s)))
            return max(stable, 1) if current == 0 else stable
        if recommendation < current:
            return min(bounded, max(within(policy.down_window_s)))
        return bounded
