"""Fault isolation in the engine core: one sequence's failure ends that sequence only.

Faults are injected into the real (tiny, randomly initialised) model and engine: a NaN row in
the input embedding makes every sequence that reads that token produce NaN logits, a
detokenizer raises for one request, a runner forward raises (a device error).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from slotserve.engine.core.async_engine import AsyncEngine
from slotserve.engine.core.errors import EngineNotRunningError
from slotserve.engine.core.model.sampling import sample_tokens
from slotserve.engine.core.params import GREEDY_TEMPERATURE_EPSILON, SamplingParams
from slotserve.engine.core.sequence import SequenceError
from tests.engine.engine_core_support import build_sharp_tiny_model, make_engine

PROMPTS = [[11, 12, 13], [200, 201, 202, 203, 204], [7, 8], [500, 42, 42, 9]]
POISON = 4321  # an id none of the clean prompts holds


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def poison(engine, token_id: int = POISON) -> None:
    """Every sequence that reads ``token_id`` gets NaN hidden states, keys, values and logits."""
    with torch.no_grad():
        engine.runner.model.get_input_embeddings().weight[token_id] = float("nan")


def generate_alone(model_dir, prompts, params) -> list[list[int]]:
    engine = make_engine(model_dir, max_batch_size=1)
    return [r.token_ids for r in engine.generate(prompts, params)]


def run(engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]], max_steps=500):
    """Step to the end, adding requests at the given steps; final outputs by request id."""
    tokens: dict[str, list[int]] = {}
    finals = {}
    step = 0
    while any(s >= step for s in arrivals) or engine.has_unfinished():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finished:
                finals[output.request_id] = output
        step += 1
        assert step < max_steps, "the engine did not finish"
    return tokens, finals


# ---------------------------------------------------------------------------------- sampling


def test_tiny_temperature_is_greedy_and_sampling_is_total():
    logits = torch.randn(5, 100) * 1000
    logits[3, :] = float("-inf")
    logits[4, 17] = float("nan")
    params = [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=GREEDY_TEMPERATURE_EPSILON, seed=1),  # sampled, not greedy
        SamplingParams(temperature=2.0, top_p=0.5, top_k=3, seed=2),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0),
    ]
    generators = [None] + [torch.Generator().manual_seed(i) for i in range(1, 5)]
    samples = sample_tokens(logits, params, generators)
    assert params[0].is_greedy and not params[1].is_greedy
    assert samples[0] == int(logits[0].argmax())
    # Logits * 1e5 (1000s / 1e-5) would overflow without the shift: still the top token.
    assert samples[1] == int(logits[1].argmax())
    assert samples[2] in logits[2].topk(3).indices.tolist()
    assert [s.reason if isinstance(s, SequenceError) else s for s in samples[3:]] == [
        "non_finite_logits"
    ] * 2


# ------------------------------------------------------------------------------ the engine


def test_tiny_temperature_beside_four_greedy_streams(model_dir):
    """The reported scenario: temperature 1e-40 next to four greedy streams killed all five."""
    expected = generate_alone(model_dir, PROMPTS, greedy())
    engine = make_engine(model_dir, max_batch_size=8)
    tiny = SamplingParams(max_tokens=24, temperature=1e-40, ignore_eos=True, seed=5)
    arrivals = {0: [(f"g{i}", p, greedy()) for i, p in enumerate(PROMPTS[:2])]}
    arrivals[3] = [("tiny", [5, 6, 7], tiny)]
    arrivals[4] = [(f"g{i}", p, greedy()) for i, p in enumerate(PROMPTS[2:], start=2)]
    tokens, finals = run(engine, arrivals)
    for i in range(4):
        assert finals[f"g{i}"].finish_reason == "length"
        assert tokens[f"g{i}"] == expected[i]
    assert finals["tiny"].finish_reason == "length"  # below the epsilon: greedy
    assert tokens["tiny"] == generate_alone(model_dir, [[5, 6, 7]], greedy())[0]


def test_non_finite_logits_end_only_that_sequence(model_dir):
    expected = generate_alone(model_dir, PROMPTS, greedy())
    engine = make_engine(model_dir, max_batch_size=8)
    poison(engine)
    arrivals = {0: [(f"g{i}", p, greedy()) for i, p in enumerate(PROMPTS)]}
    arrivals[2] = [("bad", [3, POISON, 5], greedy())]
    tokens, finals = run(engine, arrivals)
    for i in range(4):
        assert finals[f"g{i}"].finish_reason == "length"
        assert tokens[f"g{i}"] == expected[i], f"g{i} changed beside a failing sequence"
    bad = finals["bad"]
    assert bad.finish_reason == "error" and bad.error.reason == "non_finite_logits"
    assert bad.num_generated_tokens == 0 and tokens["bad"] == []
    stats = engine.stats()
    assert stats.sequence_failures == {"non_finite_logits": 1}
    assert stats.num_running == 0 and stats.num_slots_free == 8 and stats.kv_cache_usage == 0


def test_a_failed_sequences_slot_is_clean_for_the_next(model_dir):
    """The failed sequence left NaN keys/values in its slot row; its next owner is shorter
    than a running neighbour, so it reads that row's positions past its own (masked) ones."""
    long_prompt = [3, POISON, *range(100, 140)]
    expected = generate_alone(model_dir, [[11, 12, 13], [7, 8]], greedy(40))
    engine = make_engine(model_dir, max_batch_size=2)
    poison(engine)
    arrivals = {
        0: [("long", [11, 12, 13], greedy(40))],
        1: [("bad", long_prompt, greedy())],
        3: [("next", [7, 8], greedy(40))],
    }
    tokens, finals = run(engine, arrivals)
    assert finals["bad"].error.reason == "non_finite_logits"
    assert finals["long"].finish_reason == finals["next"].finish_reason == "length"
    assert tokens["long"] == expected[0]
    assert tokens["next"] == expected[1]


def test_a_detokenizer_error_ends_only_that_sequence(model_dir):
    expected = generate_alone(model_dir, PROMPTS, greedy())
    engine = make_engine(model_dir, max_batch_size=8)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"g{i}", prompt, greedy())
    engine.add_request("bad", [9, 9, 9], greedy())
    detokenizer = engine._detokenizers["bad"]
    add_tokens = detokenizer.add_tokens

    def fail_on_the_third(token_ids, *, final=False):
        if len(detokenizer.token_ids) >= 5:  # 3 prompt tokens as context + 2 outputs
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return add_tokens(token_ids, final=final)

    # The fault injected into this one detokenizer: mypy refuses any assignment to a method.
    detokenizer.add_tokens = fail_on_the_third  # type: ignore[method-assign]
    tokens, finals = run(engine, {})
    for i in range(4):
        assert finals[f"g{i}"].finish_reason == "length"
        assert tokens[f"g{i}"] == expected[i]
    bad = finals["bad"]
    assert bad.finish_reason == "error" and bad.error.reason == "detokenizer"
    assert "UnicodeDecodeError" in bad.error.message
    assert bad.num_generated_tokens == 3
    assert engine.stats().sequence_failures == {"detokenizer": 1}


# ------------------------------------------------------------------------- a broken runner


async def test_a_broken_runner_ends_everything_and_says_so(model_dir):
    engine = AsyncEngine(make_engine(model_dir, max_batch_size=2, max_waiting=8))
    await engine.start()
    try:
        streams = [engine.add_request(f"r{i}", [11, 12, 13], greedy(400)) for i in range(4)]
        first = await asyncio.wait_for(streams[0].__anext__(), 30)
        assert not first.finished

        def device_error(chunks):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        # The fault injected into this one runner: mypy refuses any assignment to a method.
        engine.engine.runner.execute = device_error  # type: ignore[method-assign]
        for stream in streams:
            outputs = await asyncio.wait_for(collect(stream), 30)
            final = outputs[-1]
            assert final.finish_reason == "error"
            assert final.error.reason == "engine_failure" and final.error.is_engine_failure
        assert engine.failure == "engine step failed: RuntimeError"
        assert not engine.is_running
        stats = engine.stats()
        assert stats.num_step_failures == 1
        assert stats.num_running == stats.num_waiting == 0
        assert stats.sequence_failures == {"engine_failure": 4}
        with pytest.raises(EngineNotRunningError):
            engine.add_request("late", [1, 2], greedy())
    finally:
        await asyncio.wait_for(engine.shutdown(), 30)


async def collect(stream):
    return [output async for output in stream]


def test_sequence_error_names_its_reason():
    error = SequenceError("sampling", "sampling failed: RuntimeError")
    assert not error.is_engine_failure
