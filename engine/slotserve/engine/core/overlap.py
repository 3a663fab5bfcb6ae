"""Overlapped decode steps: the host postprocesses step N while the device runs step N+1.

vLLM's async scheduling, for the static decode step. A step whose rows are all static decodes
is launched without waiting for its result (the result's copy to the host is queued behind it).
At the next call, before anything waits, the scheduler plans step N+1 from step N's plan
(:meth:`Scheduler.plan_ahead`): the same sequences, each decoding the token that N is sampling.
The runner launches it with those input tokens taken on the device from N's sampled tokens, and
only then does the host wait for N's result and postprocess it (detokenize, stop checks,
outputs), while the device runs N+1.

Exact, not speculative: N+1 is launched only when it is the step that :meth:`Scheduler.schedule`
would plan once N's tokens are in, minus what the host cannot know yet. Sequences that N ends by
``max_tokens`` get no row (that is known ahead); a sequence that N ends by a stop token or a stop
string, or whose request is aborted meanwhile, still gets one, and that row's token is dropped
at N+1's collect: never emitted, never counted. Its slot stays unused until N+1 is collected,
since anything that could take it (an admission, an abort, a preemption) makes the next call wait
for the step in flight and plan as usual. Every other step (prefill chunks, rows the device
sampler does not serve, a bucket not compiled yet) runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slotserve.engine.core.scheduler import Scheduler, StepPlan
from slotserve.engine.core.sequence import SequenceError, SequenceStatus

if TYPE_CHECKING:
    from slotserve.engine.core.logprobs import SampledLogprobs
    from slotserve.engine.core.protocols import Launcher


@dataclass
class InFlight:
    plan: StepPlan
    launched: Any  # the runner's handle


@dataclass
class Collected:
    """A step's results for the rows whose sequences still want them."""

    plan: StepPlan
    samples: list[int | SequenceError]
    logprobs: list[SampledLogprobs | None]


class StepOverlap:
    """Holds the step in flight; launches the next one before waiting for it."""

    def __init__(self, scheduler: Scheduler, runner: Launcher) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.in_flight: InFlight | None = None
        self.num_launched = 0
        self.num_chained = 0  # launched before the previous step's result was read
        self.num_dropped_rows = 0  # rows of sequences that ended before their step came back

    def launch(self, plan: StepPlan) -> bool:
        """Start ``plan`` without waiting when the runner can (True: collected next call)."""
        if self.in_flight is not None or not self.runner.can_launch(plan.chunks):
            return False
        self.in_flight = InFlight(plan, self.runner.launch(plan.chunks))
        self.num_launched += 1
        return True

    def advance(self) -> tuple[Collected, bool]:
        """Launch the step after the one in flight if it can go now, then wait for the one in
        flight. Returns its results and whether the next step is in flight."""
        done = self.in_flight
        assert done is not None, "advance() with no step in flight"
        self.in_flight = None
        ahead = self.scheduler.plan_ahead(done.plan)
        if ahead is not None and self.runner.can_launch(ahead.chunks, chained=True):
            self.scheduler.commit_ahead(ahead)
            rows = {id(chunk.seq): row for row, chunk in enumerate(done.plan.chunks)}
            previous = [rows[id(chunk.seq)] for chunk in ahead.chunks]
            self.in_flight = InFlight(ahead, self.runner.launch(ahead.chunks, previous))
            self.num_launched += 1
            self.num_chained += 1
        return self._collect(done), self.in_flight is not None

    def _collect(self, done: InFlight) -> Collected:
        samples = self.runner.collect(done.launched)
        logprobs = list(self.runner.last_logprobs) or [None] * len(samples)
        keep = [
            chunk.seq.status is SequenceStatus.RUNNING
            and not self.scheduler.is_aborting(chunk.seq.request_id)
            for chunk in done.plan.chunks
        ]
        self.num_dropped_rows += keep.count(False)
        plan = self.scheduler.drop_rows(done.plan, keep)
        return Collected(
            plan,
            [sample for sample, flag in zip(samples, keep, strict=True) if flag],
            [entry for entry, flag in zip(logprobs, keep, strict=True) if flag],
        )

    def forget(self) -> None:
        """Drop the step in flight unread (the engine failed every request)."""
        self.in_flight = None
