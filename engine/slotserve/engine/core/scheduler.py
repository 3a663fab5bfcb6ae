"""Which sequences run in the next step, and how many of their tokens (pure Python, no torch).

Step counting, used by tests, stats and plots: a *step* is one call to :meth:`Scheduler.schedule`
that returns a non-empty plan, i.e. one batched model forward. Steps are numbered from 1. A
sequence whose prompt fits the token budget is prefilled and samples its first token in the step
that admits it, then samples one token per step; so a request for 20 tokens admitted at step 1
finishes at step 20, its slot is freed in that step's postprocess, and a waiting request is
admitted into that slot at step 21.

*Slot utilisation* = useful slot-steps / (max_batch_size x steps), where a slot-step is useful
when the slot's sequence had a chunk computed in that step (a decode, or a prefill chunk).

Policies (Triton's names). The engine alone forms batches: the gateway passes requests on as
soon as an engine has a free slot, for every policy.
- ``static``: when nothing runs, gather: a batch starts once ``max_batch_size`` sequences wait, or
  ``max_queue_delay`` has passed since the batch could start (the later of the oldest waiting
  sequence's arrival and the end of the previous batch); it takes all that wait (up to the max)
  and admits no other until every one of them has finished.
- ``dynamic``: as static, and a batch also starts once the largest preferred batch size waits;
  its size is the largest preferred size that the waiting sequences can fill, else all that wait.
- ``continuous``: every step, finished sequences have left and waiting ones join while a slot,
  their KV and the step's token budget allow; long prompts are prefilled in chunks.

The gathering window opens at the end of the previous batch, not only at the oldest arrival: the
gateway holds a pool's requests beyond its slots and sends the next ones as the batch's last
sequences finish, a moment after the engine is free; counted from the oldest arrival alone, the
next batch would start without them (and they would run as a batch of their own).

With prefix caching (the engine's default), an admitted sequence starts with the tokens its slot
row already holds marked computed, and the plan lists the row copies that must run before the
step's forward (:mod:`slotserve.engine.core.prefix_cache`).

Every step, running sequences are served oldest first (decodes and unfinished prefills) under the
token budget; if the KV budget cannot hold a decode's next token, the newest running sequence is
preempted (its KV freed; it goes back to the front of the waiting queue and is recomputed later).
Continuous only: a request the gateway marked as a tenant preemptor (``tenant_preempt.py``) that
finds every slot taken preempts the same way, before the step is planned, and takes the slot.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from slotserve.contracts.pool_spec import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS,
    DEFAULT_POLICY,
    BatchingPolicy,
)
from slotserve.engine.core.kv_cache import KVCacheManager
from slotserve.engine.core.prefix_cache import SlotCopy
from slotserve.engine.core.sequence import FinishReason, Sequence, SequenceError, SequenceStatus
from slotserve.engine.core.tenant_preempt import is_preemptor, pick_victim


@dataclass(slots=True)
class ScheduledChunk:
    """Compute tokens ``[start, start + num_tokens)`` of ``seq`` in this step."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool  # the chunk reaches the sequence's last token: the step samples a new one

    @classmethod
    def next_for(cls, seq: Sequence, budget: int) -> ScheduledChunk:
        """The sequence's next chunk: what is not computed yet, at most ``budget`` tokens."""
        num_tokens = min(seq.num_uncomputed_tokens, budget)
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, samples=start + num_tokens == seq.num_tokens)


@dataclass
class StepPlan:
    """What one step does; ``aborted`` sequences were removed before it."""

    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # for KV room
    tenant_preempted: list[Sequence] = field(default_factory=list)  # for a preemptor's slot
    aborted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    # Prefix rows to copy, in order, before the forward (later copies may read earlier ones).
    copies: list[SlotCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        return [chunk for chunk in self.chunks if chunk.samples]


@dataclass(frozen=True)
class SchedulerConfig:
    """The batching fields of ``slotserve.contracts.pool_spec``, as the step loop reads them.

    Bounds are checked where the values enter (``EngineSettings``, the CRD); this plain
    dataclass is read every step, and unit tests run it with budgets the contract refuses.
    """

    policy: BatchingPolicy = DEFAULT_POLICY
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    max_queue_delay_seconds: float = DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS / 1e6
    preferred_batch_sizes: tuple[int, ...] = ()


class Scheduler:
    """Waiting and running queues, the three policies, chunked prefill and preemption."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        *,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._pending_aborts: set[str] = set()
        self.num_steps = 0
        self.num_useful_slot_steps = 0
        self.num_preemptions = 0  # for KV room (vllm:num_preemptions)
        self.num_tenant_preemptions = 0  # for a preemptor of a tenant under its share
        self.num_tenant_recomputed_tokens = 0  # computed tokens those victims lost
        self._batch_ended_at = -math.inf  # when ``running`` last became empty

    # -- queues -----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Mark for removal; applied at the start of the next :meth:`schedule` (idempotent)."""
        self._pending_aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending_aborts)

    @property
    def slot_utilisation(self) -> float:
        slot_steps = self.num_steps * self.config.max_batch_size
        return self.num_useful_slot_steps / slot_steps if slot_steps else 0.0

    def next_step_delay(self, now: float) -> float:
        """Seconds until :meth:`schedule` can return work: 0 now, ``math.inf`` when idle."""
        if self.running or self._pending_aborts:
            return 0.0
        if not self.waiting:
            return math.inf
        if self.config.policy == "continuous" or self._batch_ready(now):
            return 0.0
        return max(0.0, self._gather_deadline() - now)

    def may_gather(self) -> bool:
        """Whether the next step starts an idle engine with room to spare: continuous
        batching, nothing running, and the waiting prompts short of the step's token budget and
        of the slots. Then a prompt still being tokenized is worth a short wait
        (:class:`~slotserve.engine.core.async_engine.AsyncEngine`'s gather)."""
        if self.config.policy != "continuous" or self.running or self._pending_aborts:
            return False
        if not 0 < len(self.waiting) < self.config.max_batch_size:
            return False
        return sum(seq.num_tokens for seq in self.waiting) < self.config.max_batched_tokens

    # -- one step ---------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        """Plan the next step. An empty plan (no chunks) does not count as a step."""
        plan = StepPlan(step=self.num_steps + 1)
        plan.aborted = self._apply_aborts(now)
        if self.config.policy == "continuous":
            self._preempt_for_tenant(plan)
        budget = self.config.max_batched_tokens
        budget = self._schedule_running(plan, budget)
        if not plan.preempted:
            self._admit(plan, budget, now)
        if plan.chunks:
            self.num_steps += 1
            self.num_useful_slot_steps += len(plan.chunks)
            for seq in plan.admitted:
                seq.admitted_step = plan.step
        else:
            plan.step = self.num_steps
        return plan

    def plan_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The step after ``plan``, planned before ``plan``'s tokens are known (overlapped
        steps; changes nothing until :meth:`commit_ahead`): each of its sequences decodes its
        pending token, except those that ``plan`` ends by max_tokens. None when that might not
        be the step :meth:`schedule` plans once the tokens are in: aborts to apply, requests
        that could join, a running sequence left out, the token budget or KV room short (a
        preemption), or no row left.

        A sequence that ``plan`` ends otherwise (a stop token or string) still gets a row; its
        token is dropped (:meth:`drop_rows`).
        """
        if self._pending_aborts or (self.waiting and self.config.policy == "continuous"):
            return None
        chunks = plan.chunks
        if len(chunks) != len(self.running) or len(chunks) > self.config.max_batched_tokens:
            return None
        if not all(chunk.samples and chunk.num_tokens == 1 for chunk in chunks):
            return None
        seqs = [
            chunk.seq
            for chunk in chunks
            if chunk.seq.num_generated_tokens + 1 < chunk.seq.params.max_tokens
        ]
        growth = sum(seq.num_tokens + 1 - seq.num_kv_tokens for seq in seqs)
        if not seqs or growth > self.kv_cache.num_tokens_free:
            return None
        ahead = StepPlan(step=self.num_steps + 1)
        # The pending token sits at position num_tokens: it is each chunk's input.
        ahead.chunks = [ScheduledChunk(seq, seq.num_tokens, 1, samples=True) for seq in seqs]
        return ahead

    def commit_ahead(self, ahead: StepPlan) -> None:
        """Count a step from :meth:`plan_ahead` and reserve its rows' pending tokens."""
        for chunk in ahead.chunks:
            self.kv_cache.append(chunk.seq, num_pending=1)
        self.num_steps += 1
        self.num_useful_slot_steps += len(ahead.chunks)

    def drop_rows(self, plan: StepPlan, keep: Seq[bool]) -> StepPlan:
        """``plan`` without the chunks not kept (their sequences ended while it ran): they
        were no useful slot-steps."""
        kept = [chunk for chunk, flag in zip(plan.chunks, keep, strict=True) if flag]
        self.num_useful_slot_steps -= len(plan.chunks) - len(kept)
        return StepPlan(step=plan.step, chunks=kept)

    def is_aborting(self, request_id: str) -> bool:
        """An abort of ``request_id`` waits for the next :meth:`schedule`."""
        return request_id in self._pending_aborts

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        queue = deque(self.running)
        while queue and budget > 0:
            seq = queue.popleft()
            while not self.kv_cache.can_append(seq):
                # Decode growth would overflow the budget: the newest running sequence goes.
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.kv_cache.append(seq)
            chunk = ScheduledChunk.next_for(seq, budget)
            plan.chunks.append(chunk)
            budget -= chunk.num_tokens
        return budget

    def _admit(self, plan: StepPlan, budget: int, now: float) -> None:
        policy = self.config.policy
        if not self.waiting:
            return
        if policy == "continuous":
            limit = self.config.max_batch_size
        elif self.running:
            return  # static and dynamic: a running batch admits nobody until it drains
        elif not self._batch_ready(now):
            return
        elif policy == "static":
            limit = self.config.max_batch_size
        else:
            limit = self._dynamic_batch_size()
        num_admitted = 0
        while self.waiting and num_admitted < limit and self.kv_cache.can_allocate(self.waiting[0]):
            # Continuous admits only what gets a chunk now; a static batch is admitted whole and
            # its prefills share the budget over the next steps.
            if policy == "continuous" and budget <= 0:
                break
            # Continuous only: a static or dynamic batch is admitted whole.
            if policy == "continuous" and self.kv_cache.should_wait_for_prefix(self.waiting[0]):
                break
            seq = self.waiting.popleft()
            plan.copies.extend(self.kv_cache.allocate(seq))
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            plan.admitted.append(seq)
            num_admitted += 1
            if budget > 0:
                chunk = ScheduledChunk.next_for(seq, budget)
                plan.chunks.append(chunk)
                budget -= chunk.num_tokens

    def _batch_ready(self, now: float) -> bool:
        """Static and dynamic, nothing running: has the gathering ended?"""
        num_waiting = len(self.waiting)
        if num_waiting >= self.config.max_batch_size:
            return True
        preferred = self.config.preferred_batch_sizes
        if self.config.policy == "dynamic" and preferred and num_waiting >= max(preferred):
            return True
        return now >= self._gather_deadline()

    def _gather_deadline(self) -> float:
        opened = max(self.waiting[0].arrival_time, self._batch_ended_at)
        return opened + self.config.max_queue_delay_seconds

    def _dynamic_batch_size(self) -> int:
        available = min(len(self.waiting), self.config.max_batch_size)
        fitting = [size for size in self.config.preferred_batch_sizes if size <= available]
        return max(fitting) if fitting else available

    def _preempt(self, seq: Sequence, *, for_tenant: bool = False) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        if for_tenant:
            self.num_tenant_preemptions += 1
        else:
            self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _preempt_for_tenant(self, plan: StepPlan) -> None:
        """While every slot runs, each waiting preemptor takes a running sequence's slot
        (``tenant_preempt.pick_victim``); the preemptors go first, in their order, their victims
        right behind them, so a victim resumes at the next free slot. The gateway sends an engine
        at most half its slots of preemptors at a time (``preempt_share.max_outstanding``); all
        that wait here are placed at this step."""
        if self.kv_cache.num_free_slots > 0:
            return  # a slot frees for the queue's front: nobody needs to be preempted
        placed = []
        for preemptor in [seq for seq in self.waiting if is_preemptor(seq)]:
            victim = pick_victim(self.running, preemptor)
            if victim is None:
                continue  # only its own tenant runs here: it waits like anyone
            self.num_tenant_recomputed_tokens += victim.num_computed_tokens
            self._preempt(victim, for_tenant=True)
            plan.tenant_preempted.append(victim)
            placed.append(preemptor)
        for preemptor in reversed(placed):
            self.waiting.remove(preemptor)
            self.waiting.appendleft(preemptor)

    def _apply_aborts(self, now: float) -> list[Sequence]:
        if not self._pending_aborts:
            return []
        aborted = [
            seq for seq in [*self.running, *self.waiting] if seq.request_id in self._pending_aborts
        ]
        self._pending_aborts.clear()
        for seq in aborted:
            if seq.status is SequenceStatus.RUNNING:
                self._leave_running(seq, now)
            else:
                self.waiting.remove(seq)
            self._finish(seq, "abort", now)
        return aborted

    # -- after the step ---------------------------------------------------------------------

    def postprocess(
        self, plan: StepPlan, samples: Seq[int | SequenceError], now: float
    ) -> list[Sequence]:
        """Record the step's results: per sampling chunk, in plan order, the sampled token or
        why that sequence could not get one (it alone ends with "error").

        Returns the sequences that finished (stop token, max_tokens, error); their slots are free.
        """
        sampling = plan.sampling_chunks
        if len(samples) != len(sampling):
            raise ValueError(f"expected {len(sampling)} sampled tokens, got {len(samples)}")
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
        finished = []
        for chunk, token_id in zip(sampling, samples, strict=True):
            seq = chunk.seq
            if isinstance(token_id, SequenceError):
                self.fail(seq, token_id, now)
                seq.finished_step = plan.step
                finished.append(seq)
                continue
            seq.token_ids.append(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
            elif seq.last_token_time is not None:
                seq.inter_token_latencies.append(now - seq.last_token_time)
            seq.last_token_time = now
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self._leave_running(seq, now)
                self._finish(seq, reason, now)
                seq.finished_step = plan.step
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        """End a running sequence early (a stop string matched); its slot is free at once."""
        if seq.is_finished:
            return
        if seq in self.running:
            self._leave_running(seq, now)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason, now)

    def fail(self, seq: Sequence, error: SequenceError, now: float) -> None:
        """End one sequence with "error"; one that has just finished (its last output could
        not be produced) turns to "error" too. Its slot is free at once."""
        self.finish(seq, "error", now)
        seq.finish_reason = "error"
        seq.error = error

    def _leave_running(self, seq: Sequence, now: float) -> None:
        self.running.remove(seq)
        if not self.running:
            self._batch_ended_at = now

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        ):
            return "stop"
        if seq.num_generated_tokens >= params.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        # A failed sequence's keys and values may be NaN: its row must not be reused.
        self.kv_cache.free(seq, keep_prefix=reason != "error")
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
