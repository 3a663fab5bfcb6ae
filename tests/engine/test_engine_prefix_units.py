"""Prefix cache bookkeeping (pure Python): which slot a sequence takes and what it reuses."""

from __future__ import annotations

import random

import pytest

from slotserve.engine.core.kv_cache import KVCacheManager
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.prefix_cache import (
    MIN_REUSE_TOKENS,
    MIN_WAIT_TOKENS,
    SlotCopy,
    common_prefix_len,
)
from slotserve.engine.core.scheduler import Scheduler, SchedulerConfig
from slotserve.engine.core.sequence import Sequence, SequenceError

SYSTEM = list(range(1000, 1100))  # a 100-token "system prompt"


def seq(request_id: str, token_ids: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams(max_tokens=max_tokens), 0.0)


def finish_prefill(s: Sequence) -> None:
    """As if the step computed the whole prompt and sampled one token."""
    s.num_computed_tokens = s.num_tokens
    s.token_ids.append(7)


@pytest.mark.parametrize("seed", range(5))
def test_common_prefix_len_matches_a_plain_scan(seed):
    rng = random.Random(seed)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(9))]
        limit = rng.randrange(50)
        expected = 0
        while expected < min(len(a), len(b), limit) and a[expected] == b[expected]:
            expected += 1
        assert common_prefix_len(a, b, limit) == expected


def test_a_freed_row_is_reused_in_place_and_the_last_token_is_always_computed():
    kv = KVCacheManager(num_slots=2, num_tokens_total=4000, enable_prefix_caching=True)
    first = seq("a", [*SYSTEM, 1, 2, 3])
    assert kv.allocate(first) == ()
    assert (first.slot, first.num_computed_tokens) == (0, 0)
    finish_prefill(first)
    kv.free(first)
    filler = seq("f", [5, 6, 7])
    kv.allocate(filler)
    finish_prefill(filler)
    kv.free(filler)  # no row is empty now

    second = seq("b", [*SYSTEM, 9, 9])
    assert kv.allocate(second) == ()
    assert (second.slot, second.num_computed_tokens) == (0, len(SYSTEM))
    kv.free(second)  # it computed nothing: the row now holds only what it reused

    same = seq("c", list(SYSTEM))
    kv.allocate(same)
    assert same.num_computed_tokens == len(SYSTEM) - 1  # the last token gives the logits
    assert kv.num_prefix_query_tokens == 103 + 3 + 102 + 100
    assert kv.num_prefix_hit_tokens == 100 + 99


def test_while_an_empty_row_is_free_a_shared_prefix_is_copied_not_cut():
    """Two conversations with one system prompt, one after the other on a fresh engine: the
    second takes an empty row (a copy of the prompt) and leaves the first's history whole."""
    kv = KVCacheManager(num_slots=4, num_tokens_total=4000, enable_prefix_caching=True)
    first = seq("a", [*SYSTEM, 1, 2, 3])
    kv.allocate(first)
    finish_prefill(first)
    kv.free(first)
    second = seq("b", [*SYSTEM, 9, 9])
    assert kv.allocate(second) == (SlotCopy(src_slot=0, dst_slot=1, num_tokens=len(SYSTEM)),)
    assert (second.slot, second.num_computed_tokens) == (1, len(SYSTEM))
    finish_prefill(second)
    kv.free(second)
    again = seq("a2", [*SYSTEM, 1, 2, 3, 4])  # the first conversation's next turn
    assert kv.allocate(again) == ()
    assert (again.slot, again.num_computed_tokens) == (0, len(SYSTEM) + 3)


def test_a_running_rows_prefix_is_copied_into_a_free_slot():
    kv = KVCacheManager(num_slots=3, num_tokens_total=4000, enable_prefix_caching=True)
    running = seq("a", [*SYSTEM, 1])
    kv.allocate(running)
    finish_prefill(running)
    other = seq("b", [*SYSTEM, 2, 3])
    assert kv.allocate(other) == (SlotCopy(src_slot=0, dst_slot=1, num_tokens=len(SYSTEM)),)
    assert (other.slot, other.num_computed_tokens) == (1, len(SYSTEM))
    # Only what the running row has computed counts: a row mid-prefill offers its computed part.
    half = seq("c", [*SYSTEM, 5])
    running.num_computed_tokens = 40
    other.num_computed_tokens = 0
    assert kv.allocate(half) == (SlotCopy(0, 2, 40),)


def test_short_matches_neither_evict_a_useful_row_nor_copy():
    kv = KVCacheManager(num_slots=2, num_tokens_total=4000, enable_prefix_caching=True)
    holder = seq("a", [*SYSTEM, 1])
    kv.allocate(holder)
    finish_prefill(holder)
    kv.free(holder)  # slot 0 keeps the system prompt
    short = seq("b", [*SYSTEM[: MIN_REUSE_TOKENS - 1], 77, 78])
    assert kv.allocate(short) == ()
    assert short.slot == 1  # the empty row, not the one holding the system prompt
    assert short.num_computed_tokens == 0
    kv.free(short)
    # Among rows that hold something, the least recently released goes first.
    newer = seq("c", [500] * 20)
    kv.allocate(newer)
    assert newer.slot == 1
    finish_prefill(newer)
    kv.free(newer)
    third = seq("d", [600] * 20)
    kv.allocate(third)
    assert third.slot == 0


def test_disabled_cache_keeps_lowest_slot_first_and_reuses_nothing():
    kv = KVCacheManager(num_slots=2, num_tokens_total=4000)
    first = seq("a", [*SYSTEM, 1])
    kv.allocate(first)
    finish_prefill(first)
    kv.free(first)
    again = seq("b", [*SYSTEM, 1])
    assert kv.allocate(again) == ()
    assert (again.slot, again.num_computed_tokens) == (0, 0)
    assert kv.num_prefix_query_tokens == kv.num_prefix_hit_tokens == 0


def test_scheduler_prefills_only_the_rest_and_forgets_failed_rows():
    kv = KVCacheManager(num_slots=2, num_tokens_total=4000, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=2, max_batched_tokens=512), kv)
    scheduler.add(seq("a", [*SYSTEM, 1, 2], max_tokens=1))
    plan = scheduler.schedule(0.0)
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(0, 102)]
    scheduler.postprocess(plan, [5], 0.0)  # max_tokens 1: finished, row kept

    scheduler.add(seq("b", [*SYSTEM, 3], max_tokens=2))
    scheduler.add(seq("c", [*SYSTEM, 4, 4], max_tokens=2))
    plan = scheduler.schedule(0.0)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [
        ("b", 100, 1),
        ("c", 100, 2),
    ]
    # "b" copies the shared prompt into the empty row ("a"'s history stays whole while a row is
    # empty), then "c" reuses "a"'s row in place (no row is empty any more).
    assert plan.copies == [SlotCopy(0, 1, 100)]
    assert [c.seq.slot for c in plan.chunks] == [1, 0]
    # "b" fails (say NaN logits): its row is forgotten, "c"'s stays.
    error = SequenceError("non_finite_logits", "NaN")
    scheduler.postprocess(plan, [error, 6], 0.0)
    assert kv.prefix_cache is not None
    assert kv.prefix_cache.row_tokens(1) == []
    scheduler.add(seq("d", [*SYSTEM, 8], max_tokens=1))
    plan = scheduler.schedule(0.0)
    (chunk,) = [c for c in plan.chunks if c.seq.request_id == "d"]
    assert (chunk.seq.slot, chunk.start) == (1, 100)
    assert plan.copies == [SlotCopy(0, 1, 100)]


def test_a_preempted_sequence_resumes_from_its_own_row():
    kv = KVCacheManager(num_slots=2, num_tokens_total=4000, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=2), kv)
    s = seq("a", [*SYSTEM, 1], max_tokens=10)
    scheduler.add(s)
    plan = scheduler.schedule(0.0)
    scheduler.postprocess(plan, [5], 0.0)
    scheduler._preempt(s)
    assert s.num_computed_tokens == 0
    plan = scheduler.schedule(0.0)
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(101, 1)]
    assert kv.num_prefix_query_tokens == 101  # recomputes are not queries


def test_requests_arriving_together_wait_for_the_first_ones_prefill():
    system = list(range(2000, 2000 + MIN_WAIT_TOKENS))
    kv = KVCacheManager(num_slots=3, num_tokens_total=4000, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=3, max_batched_tokens=1024), kv)
    for name, tail in (("a", [1]), ("b", [2]), ("c", [3])):
        scheduler.add(seq(name, [*system, *tail], max_tokens=3))
    chunks = []
    for _ in range(2):
        plan = scheduler.schedule(0.0)
        chunks.append([(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks])
        samples = [5] * len(plan.sampling_chunks)
        scheduler.postprocess(plan, samples, 0.0)
    # "a" prefills the shared prompt (a copy runs before the forward, so a row is only copied
    # once computed); then "b" and "c" copy its row and prefill their last token.
    n = len(system)
    assert chunks == [[("a", 0, n + 1)], [("a", n + 1, 1), ("b", n, 1), ("c", n, 1)]]
    assert kv.num_prefix_hit_tokens == 2 * n


def test_waiting_ends_once_the_rest_is_cheaper_to_compute():
    system = list(range(2000, 2000 + MIN_WAIT_TOKENS))
    kv = KVCacheManager(num_slots=2, num_tokens_total=4000, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=2, max_batched_tokens=200), kv)
    scheduler.add(seq("a", [*system, 1]))
    scheduler.add(seq("b", [*system, 2]))
    plan = scheduler.schedule(0.0)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("a", 0, 200)]
    scheduler.postprocess(plan, [], 0.0)
    # 200 tokens are in a's row; the 56 it has still to compute are not worth another step.
    plan = scheduler.schedule(0.0)
    assert [(c.seq.request_id, c.start) for c in plan.chunks] == [("a", 200), ("b", 200)]
    assert plan.copies == [SlotCopy(0, 1, 200)]


def test_a_short_shared_prefix_is_not_worth_a_wait():
    kv = KVCacheManager(num_slots=2, num_tokens_total=4000, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=2, max_batched_tokens=512), kv)
    scheduler.add(seq("a", [*SYSTEM, 1]))
    scheduler.add(seq("b", [*SYSTEM, 2]))  # 100 shared tokens: cheaper to prefill than to wait
    plan = scheduler.schedule(0.0)
    assert [(c.seq.request_id, c.start) for c in plan.chunks] == [("a", 0), ("b", 0)]


def test_static_batches_are_admitted_whole_without_waiting():
    kv = KVCacheManager(num_slots=2, num_tokens_total=4000, enable_prefix_caching=True)
    scheduler = Scheduler(
        SchedulerConfig(policy="static", max_batch_size=2, max_batched_tokens=64), kv
    )
    scheduler.add(seq("a", [*SYSTEM, 1]))
    scheduler.add(seq("b", [*SYSTEM, 2]))
    plan = scheduler.schedule(0.0)
    assert [s.request_id for s in plan.admitted] == ["a", "b"]
