"""Tenant preemption (issue 26): a gateway preemptor takes a running sequence's slot at once,
and the victim's answer is exactly what it would have been without the preemption."""

from __future__ import annotations

import pytest

from slotserve.engine.core.kv_cache import KVCacheManager
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.scheduler import Scheduler, SchedulerConfig
from slotserve.engine.core.sequence import Sequence, SequenceStatus
from tests.engine.engine_core_support import build_sharp_tiny_model, make_engine, make_prompts

TOKEN = 7


def seq_of(name: str, tenant: str, *, victim: str | None = None, max_tokens: int = 50) -> Sequence:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        cache_salt=tenant,
        preempt_tenant=victim,
    )
    return Sequence(name, [1, 2, 3, 4], params, arrival_time=0.0)


def scheduler_of(policy: str = "continuous", slots: int = 2) -> Scheduler:
    config = SchedulerConfig(policy=policy, max_batch_size=slots, max_batched_tokens=2048)  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_slots=slots, num_tokens_total=10_000))


def step(scheduler: Scheduler):
    plan = scheduler.schedule(0.0)
    scheduler.postprocess(plan, [TOKEN] * len(plan.sampling_chunks), 0.0)
    return plan


def test_preemptor_takes_the_newest_slot_of_the_named_tenant_and_the_victim_resumes_first():
    scheduler = scheduler_of()
    a_old, b_run, a_new = seq_of("a-old", "a"), seq_of("b-run", "b"), seq_of("a-new", "a")
    scheduler.add(a_old)
    scheduler.add(b_run)
    step(scheduler)
    scheduler.finish(b_run, "stop", 0.0)
    scheduler.add(a_new)
    step(scheduler)  # a-old and a-new run: every slot taken
    preemptor = seq_of("c", "c", victim="a")
    scheduler.add(preemptor)
    plan = step(scheduler)
    assert plan.tenant_preempted == [a_new] and plan.preempted == []
    assert preemptor in plan.admitted and preemptor.status is SequenceStatus.RUNNING
    assert list(scheduler.waiting) == [a_new]
    assert (scheduler.num_tenant_preemptions, scheduler.num_preemptions) == (1, 0)
    assert scheduler.num_tenant_recomputed_tokens == 4  # its prompt (its sampled token: not yet)
    scheduler.finish(a_old, "stop", 0.0)
    plan = step(scheduler)
    assert a_new in plan.admitted  # the victim takes the next free slot first


def test_never_a_sequence_of_the_preemptors_own_tenant():
    scheduler = scheduler_of()
    for name in ("c1", "c2"):
        scheduler.add(seq_of(name, "c"))
    step(scheduler)
    preemptor = seq_of("c3", "c", victim="a")
    scheduler.add(preemptor)
    plan = step(scheduler)
    assert plan.tenant_preempted == [] and preemptor.status is SequenceStatus.WAITING
    assert scheduler.num_tenant_preemptions == 0


def test_another_tenant_when_the_named_one_no_longer_runs():
    scheduler = scheduler_of()
    for name, tenant in (("b1", "b"), ("d1", "d")):
        scheduler.add(seq_of(name, tenant))
    step(scheduler)
    scheduler.add(seq_of("c", "c", victim="a"))
    plan = step(scheduler)
    assert [seq.request_id for seq in plan.tenant_preempted] == ["d1"]


def test_no_preemption_while_a_slot_is_free_or_a_batch_runs_to_its_end():
    scheduler = scheduler_of()
    scheduler.add(seq_of("a1", "a"))
    step(scheduler)
    scheduler.add(seq_of("c", "c", victim="a"))
    plan = step(scheduler)
    assert plan.tenant_preempted == [] and len(scheduler.running) == 2
    static = scheduler_of("static")
    for name in ("a1", "a2"):
        static.add(seq_of(name, "a"))
    step(static)
    static.add(seq_of("c", "c", victim="a"))
    assert step(static).tenant_preempted == []


def test_every_waiting_preemptor_is_placed_at_one_step():
    scheduler = scheduler_of(slots=4)
    running = [seq_of(f"a{i}", "a") for i in range(4)]
    for seq in running:
        scheduler.add(seq)
    step(scheduler)
    b1, b2 = seq_of("b1", "b", victim="a"), seq_of("b2", "b", victim="a")
    scheduler.add(b1)
    scheduler.add(b2)
    plan = step(scheduler)
    assert plan.tenant_preempted == [running[3], running[2]]  # the newest first
    assert b1 in plan.admitted and b2 in plan.admitted
    assert list(scheduler.waiting) == [running[2], running[3]]  # they resume first
    assert scheduler.num_tenant_preemptions == 2


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


def _sampled(salt: str, victim: str | None = None) -> SamplingParams:
    """Seeded sampling with penalties and logprobs: everything that carries state per sequence."""
    return SamplingParams(
        max_tokens=24,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logprobs=2,
        ignore_eos=True,
        cache_salt=salt,
        preempt_tenant=victim,
    )


def _run(engine, seqs_by_step: dict[int, list[tuple[str, list[int], SamplingParams]]]):
    """Step to the end, adding requests at their steps; each request's tokens and logprobs."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    step_no = 0
    while step_no <= max(seqs_by_step) or engine.has_unfinished():
        for request_id, prompt, params in seqs_by_step.get(step_no, []):
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            for entry in out.logprobs or []:
                logprobs.setdefault(out.request_id, []).append(entry.logprob)
        step_no += 1
        assert step_no < 500, "the engine did not finish"
    return tokens, logprobs


@pytest.mark.parametrize("prefix_cache_rows", [0, 4])
def test_a_preempted_seeded_answer_has_the_same_tokens_and_logprobs(
    sharp_model_dir, prefix_cache_rows
):
    prompts = make_prompts(3, seed=3)
    runs = []
    for victim in (None, "a"):  # b waits for a slot, or b preempts a2 (the newest of a)
        engine = make_engine(sharp_model_dir, max_batch_size=2, prefix_cache_rows=prefix_cache_rows)
        arrivals = {
            0: [("a1", prompts[0], _sampled("a")), ("a2", prompts[1], _sampled("a"))],
            6: [("b", prompts[2], _sampled("b", victim=victim))],
        }
        runs.append((engine, *_run(engine, arrivals)))
    (_, want_tokens, want_logprobs), (engine, got_tokens, got_logprobs) = runs
    stats = engine.stats()
    assert (stats.num_tenant_preemptions, stats.num_preemptions) == (1, 0)
    assert stats.tenant_recomputed_tokens_total >= len(prompts[1]) + 5
    assert got_tokens["a2"] == want_tokens["a2"]
    assert got_logprobs["a2"] == pytest.approx(want_logprobs["a2"], abs=1e-4)
    assert len(got_tokens["b"]) == 24
