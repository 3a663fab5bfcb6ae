"""Pure scheduler tests (no torch): the seed's numbers, the three policies, budgets, preemption."""

from __future__ import annotations

import math
import sys

import pytest

from slotserve.engine.core.kv_cache import KVCacheManager
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.scheduler import Scheduler, SchedulerConfig, StepPlan
from slotserve.engine.core.sequence import Sequence, SequenceStatus

SEED_LENGTHS = [20, 50, 100, 500]
TOKEN = 7  # what the fake model "samples": never a stop token here


def make_seq(name: str, max_tokens: int, *, prompt_len: int = 8, arrival: float = 0.0, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    return Sequence(name, list(range(1, prompt_len + 1)), params, arrival_time=arrival)


def make_scheduler(policy="continuous", *, slots=4, kv_tokens=100_000, budget=2048, **kw):
    config = SchedulerConfig(policy=policy, max_batch_size=slots, max_batched_tokens=budget, **kw)
    kv = KVCacheManager(num_slots=slots, num_tokens_total=kv_tokens)
    return Scheduler(config, kv, eos_token_ids=[0])


def run_step(scheduler: Scheduler, now: float = 0.0) -> StepPlan:
    """One engine step with a fake model that samples TOKEN for every sampling chunk."""
    plan = scheduler.schedule(now)
    scheduler.postprocess(plan, [TOKEN] * len(plan.sampling_chunks), now)
    return plan


def run_to_end(scheduler: Scheduler, max_steps: int = 10_000) -> list[StepPlan]:
    plans = []
    while scheduler.has_unfinished():
        plans.append(run_step(scheduler))
        assert len(plans) < max_steps
    return plans


def test_static_seed_example_500_steps_670_of_2000():
    scheduler = make_scheduler("static")
    seqs = [make_seq(f"r{n}", n) for n in SEED_LENGTHS]
    for seq in seqs:
        scheduler.add(seq)
    late = make_seq("late", 10)  # arrives at step 1, waits for the whole batch
    plans = [run_step(scheduler)]
    scheduler.add(late)
    while any(not seq.is_finished for seq in seqs):
        plans.append(run_step(scheduler))
    assert scheduler.num_steps == 500
    assert scheduler.num_useful_slot_steps == 670
    assert scheduler.num_steps * 4 == 2000
    assert scheduler.slot_utilisation == pytest.approx(0.335)
    assert [seq.finished_step for seq in seqs] == SEED_LENGTHS
    # The late request waited 499 steps, then gathers for the queue delay: admitted at step 501.
    assert late.status is SequenceStatus.WAITING
    run_step(scheduler, now=1.0)
    assert late.admitted_step == 501


def test_continuous_seed_example_slot_reused_at_step_21():
    scheduler = make_scheduler("continuous")
    seqs = [make_seq(f"r{n}", n) for n in SEED_LENGTHS]
    for seq in seqs:
        scheduler.add(seq)
    first = run_step(scheduler)
    assert {seq.slot for seq in seqs} == {0, 1, 2, 3}
    slot_of_20 = seqs[0].slot
    newcomer = make_seq("newcomer", 30)
    scheduler.add(newcomer)  # waiting since step 1: no slot is free
    assert first.step == 1
    for _ in range(19):
        run_step(scheduler)
    assert seqs[0].finished_step == 20
    assert newcomer.status is SequenceStatus.WAITING
    plan = run_step(scheduler)
    assert plan.step == 21
    assert newcomer.admitted_step == 21 and newcomer.slot == slot_of_20
    assert newcomer.num_generated_tokens == 1  # prefilled and first token in its first step


def test_seed_stream_16_requests_utilisation():
    """Cycle 20/50/100/500 x4, max_batch_size 4: static 33.5%, continuous 920 steps, 72.8%."""
    lengths = SEED_LENGTHS * 4
    static = make_scheduler("static")
    continuous = make_scheduler("continuous")
    for scheduler in (static, continuous):
        for i, n in enumerate(lengths):
            scheduler.add(make_seq(f"r{i}", n))
    run_to_end(static)
    plans = run_to_end(continuous)
    assert static.num_steps == 2000 and static.num_useful_slot_steps == 2680
    assert static.slot_utilisation == pytest.approx(0.335)
    assert continuous.num_steps == 920 and continuous.num_useful_slot_steps == 2680
    assert continuous.slot_utilisation == pytest.approx(2680 / 3680)
    # No slot idles for a step while a request waits: every step before the queue emptied is full.
    last_admission = max(i for i, plan in enumerate(plans) if plan.admitted)
    assert all(len(plan.chunks) == 4 for plan in plans[: last_admission + 1])


def test_dynamic_fires_on_size():
    scheduler = make_scheduler("dynamic", max_queue_delay_seconds=1.0)
    for i in range(3):
        scheduler.add(make_seq(f"r{i}", 5, arrival=0.0))
    assert not run_step(scheduler, now=0.5).chunks  # 3 of 4 wait, delay not reached
    assert scheduler.next_step_delay(0.5) == pytest.approx(0.5)
    scheduler.add(make_seq("r3", 5, arrival=0.5))
    plan = run_step(scheduler, now=0.5)
    assert len(plan.admitted) == 4 and plan.step == 1


def test_dynamic_fires_on_delay_with_preferred_size():
    scheduler = make_scheduler(
        "dynamic", slots=8, max_queue_delay_seconds=0.1, preferred_batch_sizes=(2, 4)
    )
    for i in range(3):
        scheduler.add(make_seq(f"r{i}", 3, arrival=0.0))
    assert not run_step(scheduler, now=0.099).chunks
    plan = run_step(scheduler, now=0.1)
    assert [seq.request_id for seq in plan.admitted] == ["r0", "r1"]  # largest preferred <= 3
    scheduler.add(make_seq("r3", 3, arrival=0.1))
    for _ in range(2):
        assert not run_step(scheduler, now=0.15).admitted  # batch running: nobody joins
    # r2 waited past the delay, but the window opens when the batch ended (at 0.15).
    assert scheduler.next_step_delay(0.15) == pytest.approx(0.1)
    assert not run_step(scheduler, now=0.2).chunks
    plan = run_step(scheduler, now=0.25)
    assert [seq.request_id for seq in plan.admitted] == ["r2", "r3"]


def test_dynamic_idle_reports_infinite_delay():
    scheduler = make_scheduler("dynamic")
    assert scheduler.next_step_delay(0.0) == math.inf


def test_static_admits_none_while_batch_runs():
    scheduler = make_scheduler("static", slots=2)
    scheduler.add(make_seq("a", 2))
    scheduler.add(make_seq("b", 5))
    run_step(scheduler)
    scheduler.add(make_seq("c", 1))
    plans = [run_step(scheduler) for _ in range(4)]
    assert all(not plan.admitted for plan in plans)  # a finished at step 2, its slot stays idle
    assert [len(plan.chunks) for plan in plans] == [2, 1, 1, 1]
    assert not run_step(scheduler).chunks  # alone: c gathers for the queue delay first
    assert run_step(scheduler, now=1.0).admitted[0].request_id == "c"


def test_static_gathers_until_the_batch_is_full():
    # Preferred batch sizes are the dynamic policy's: static waits for a full batch or the delay.
    scheduler = make_scheduler("static", max_queue_delay_seconds=1.0, preferred_batch_sizes=(2,))
    for i in range(3):
        scheduler.add(make_seq(f"r{i}", 5, arrival=0.0))
    assert not run_step(scheduler, now=0.5).chunks
    assert scheduler.next_step_delay(0.5) == pytest.approx(0.5)
    scheduler.add(make_seq("r3", 5, arrival=0.5))
    assert scheduler.next_step_delay(0.5) == 0.0
    plan = run_step(scheduler, now=0.5)
    assert [seq.request_id for seq in plan.admitted] == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_a_lone_request_waits_at_most_the_delay(policy):
    scheduler = make_scheduler(policy, max_queue_delay_seconds=0.1)
    scheduler.add(make_seq("alone", 3, arrival=2.0))
    assert scheduler.next_step_delay(2.0) == pytest.approx(0.1)
    assert not run_step(scheduler, now=2.099).chunks
    assert [seq.request_id for seq in run_step(scheduler, now=2.1).admitted] == ["alone"]


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_next_batch_gathers_from_the_end_of_the_previous(policy):
    """Requests that queued in the engine during a batch wait for the one the gateway sends as
    the batch's last slot frees, instead of leaving it to run alone."""
    scheduler = make_scheduler(policy, max_queue_delay_seconds=0.1)
    batch = [make_seq(f"b{i}", 2, arrival=0.0) for i in range(4)]
    for seq in batch:
        scheduler.add(seq)
    run_step(scheduler, now=0.0)
    queued = [make_seq(f"q{i}", 2, arrival=0.01) for i in range(3)]
    for seq in queued:
        scheduler.add(seq)
    run_step(scheduler, now=1.0)  # the batch ends; the queued ones waited 0.99 s already
    assert all(seq.is_finished for seq in batch)
    assert scheduler.next_step_delay(1.0) == pytest.approx(0.1)
    last = make_seq("last", 2, arrival=1.01)
    scheduler.add(last)
    plan = run_step(scheduler, now=1.01)
    assert plan.admitted == [*queued, last]


def test_continuous_never_gathers():
    scheduler = make_scheduler("continuous", max_queue_delay_seconds=1.0)
    scheduler.add(make_seq("alone", 3))
    assert scheduler.next_step_delay(0.0) == 0.0
    assert len(run_step(scheduler, now=0.0).admitted) == 1


def test_chunked_prefill_respects_token_budget_and_keeps_decodes_going():
    scheduler = make_scheduler("continuous", budget=16)
    short = make_seq("short", 10, prompt_len=4)
    scheduler.add(short)
    run_step(scheduler)
    long = make_seq("long", 2, prompt_len=40)
    scheduler.add(long)
    sizes = []
    while long.num_generated_tokens == 0:
        plan = run_step(scheduler)
        assert plan.num_tokens <= 16
        assert any(chunk.seq is short for chunk in plan.chunks)  # decode never stalls
        sizes.append(next(chunk.num_tokens for chunk in plan.chunks if chunk.seq is long))
    assert sizes == [15, 15, 10]


def test_kv_budget_blocks_admission_until_tokens_free():
    scheduler = make_scheduler("continuous", kv_tokens=30)
    a = make_seq("a", 5, prompt_len=20)
    b = make_seq("b", 5, prompt_len=20)
    scheduler.add(a)
    scheduler.add(b)
    plan = run_step(scheduler)
    assert plan.admitted == [a] and b.status is SequenceStatus.WAITING
    assert scheduler.kv_cache.num_tokens_used == 20
    while not a.is_finished:
        run_step(scheduler)
    assert scheduler.kv_cache.num_tokens_used == 0
    assert run_step(scheduler).admitted == [b]


def test_preemption_takes_newest_and_recomputes():
    # 3 sequences of 10-token prompts in a 32-token budget: decode growth overflows at once.
    scheduler = make_scheduler("continuous", kv_tokens=32)
    seqs = [make_seq(f"s{i}", 6, prompt_len=10) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    plan = run_step(scheduler)
    assert plan.admitted == seqs  # 30 tokens reserved
    plan = run_step(scheduler)  # s0 and s1 each need one more position: s2 (newest) goes
    assert plan.preempted == [seqs[2]]
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].num_computed_tokens == 0
    assert scheduler.waiting[0] is seqs[2]
    assert scheduler.num_preemptions == 1
    run_to_end(scheduler)
    assert all(seq.num_generated_tokens == 6 for seq in seqs)
    assert seqs[2].num_preemptions >= 1
    assert scheduler.kv_cache.num_tokens_used == 0


def test_abort_frees_slot_next_step():
    scheduler = make_scheduler("continuous", slots=1)
    a = make_seq("a", 100)
    b = make_seq("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    scheduler.abort("a")
    scheduler.abort("a")  # idempotent
    plan = run_step(scheduler)
    assert plan.aborted == [a] and a.finish_reason == "abort"
    assert plan.admitted == [b] and b.slot == 0
    scheduler.abort("unknown")
    run_to_end(scheduler)
    assert b.finish_reason == "length"


def test_abort_waiting_request():
    scheduler = make_scheduler("continuous", slots=1)
    scheduler.add(make_seq("a", 5))
    b = make_seq("b", 5)
    scheduler.add(b)
    run_step(scheduler)
    scheduler.abort("b")
    plan = run_step(scheduler)
    assert plan.aborted == [b] and not scheduler.waiting


def test_stop_token_and_eos_finish_with_stop():
    scheduler = make_scheduler("continuous")
    eos = Sequence("eos", [1, 2], SamplingParams(max_tokens=10), arrival_time=0.0)
    ignore = make_seq("ignore", 3)
    custom = make_seq("custom", 10, stop_token_ids=[9])
    for seq in (eos, ignore, custom):
        scheduler.add(seq)
    plan = scheduler.schedule(0.0)
    scheduler.postprocess(plan, [0, 0, 9], 0.0)
    assert eos.finish_reason == "stop" and custom.finish_reason == "stop"
    assert not ignore.is_finished  # ignore_eos keeps going past token 0


def test_decode_budget_smaller_than_slots():
    scheduler = make_scheduler("continuous", slots=4, budget=2)
    for i in range(4):
        scheduler.add(make_seq(f"r{i}", 3, prompt_len=1))
    for _ in range(20):
        plan = run_step(scheduler)
        assert plan.num_tokens <= 2
        if not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished()


def test_scheduler_imports_no_torch():
    assert "slotserve.engine.core.scheduler" in sys.modules
    import subprocess

    code = (
        "import sys; import slotserve.engine.core.scheduler, slotserve.engine.core.kv_cache; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_only_an_idle_step_with_room_to_spare_may_gather():
    scheduler = make_scheduler(slots=4, budget=100)
    assert not scheduler.may_gather()  # nothing waiting: nothing to hold
    scheduler.add(make_seq("a", 4, prompt_len=40))
    assert scheduler.may_gather()  # idle, 40 of 100 tokens and 1 of 4 slots taken
    scheduler.add(make_seq("b", 4, prompt_len=60))
    assert not scheduler.may_gather()  # the waiting prompts fill the step's budget
    run_step(scheduler)
    scheduler.add(make_seq("c", 4, prompt_len=8))
    assert not scheduler.may_gather()  # a running batch is never held
    full = make_scheduler(slots=2, budget=100)
    for name in ("d", "e"):
        full.add(make_seq(name, 4, prompt_len=8))
    assert not full.may_gather()  # every slot would be taken
    for policy in ("static", "dynamic"):
        other = make_scheduler(policy, slots=4, budget=100)
        other.add(make_seq("f", 4, prompt_len=8))
        assert not other.may_gather()  # they gather by their own rules
