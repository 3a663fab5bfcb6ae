"""LLMEngine on a tiny real model: stops, sampling seeds, aborts, validation, statistics."""

from __future__ import annotations

import pytest

from slotserve.engine.core.errors import InvalidRequestError, QueueFullError
from slotserve.engine.core.params import SamplingParams
from tests.engine.engine_core_support import build_sharp_tiny_model, make_engine

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir, max_batch_size=4)


def greedy(max_tokens=24, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_one(engine, prompt, params):
    return engine.generate([prompt], params)[0]


def test_text_deltas_concatenate_to_the_decoded_output(engine):
    result = run_one(engine, PROMPT, greedy())
    assert result.finish_reason == "length" and len(result.token_ids) == 24
    assert result.text == engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_text_and_frees_the_slot(engine):
    full = run_one(engine, PROMPT, greedy(40)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    result = run_one(engine, PROMPT, greedy(40, stop=[stop]))
    assert result.finish_reason == "stop"
    assert result.text == full[: full.index(stop)]
    assert len(result.token_ids) < 40
    assert engine.stats().num_running == 0 and engine.kv_cache.num_tokens_used == 0


def test_stop_token_id_ends_generation_without_its_text(engine):
    tokens = run_one(engine, PROMPT, greedy(20)).token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    result = run_one(engine, PROMPT, greedy(20, stop_token_ids=[stop_id]))
    assert result.finish_reason == "stop"
    assert result.token_ids == tokens[: first + 1]
    assert result.text == engine.tokenizer.decode(tokens[:first], skip_special_tokens=True)


def test_eos_stops_unless_ignored(engine):
    tokens = run_one(engine, PROMPT, greedy(20)).token_ids
    engine.scheduler.eos_token_ids = frozenset({tokens[3]})  # pretend the model's EOS is this
    try:
        stopped = run_one(engine, PROMPT, SamplingParams(max_tokens=20, temperature=0.0))
        ignored = run_one(engine, PROMPT, greedy(20))
    finally:
        engine.scheduler.eos_token_ids = frozenset()
    assert (
        stopped.finish_reason == "stop"
        and stopped.token_ids == tokens[: tokens.index(tokens[3]) + 1]
    )
    assert ignored.finish_reason == "length" and ignored.token_ids == tokens


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = run_one(engine, PROMPT, params).token_ids
    again = run_one(engine, PROMPT, params).token_ids
    other_seed = run_one(engine, PROMPT, params.model_copy(update={"seed": 99})).token_ids
    batch = engine.generate(
        ["another prompt", PROMPT, "a third one here"],
        [greedy(8), params, SamplingParams(max_tokens=5, seed=1)],
    )
    assert alone == again == batch[1].token_ids
    assert alone != other_seed


def test_top_k_1_is_greedy(engine):
    sampled = run_one(engine, PROMPT, SamplingParams(max_tokens=12, top_k=1, ignore_eos=True))
    assert sampled.token_ids == run_one(engine, PROMPT, greedy(12)).token_ids


def test_abort_frees_the_slot_at_the_next_step(model_dir):
    engine = make_engine(model_dir, max_batch_size=1)
    engine.add_request("long", PROMPT, greedy(200))
    engine.add_request("next", PROMPT, greedy(3))
    engine.step()
    engine.abort("long")
    engine.abort("long")
    outputs = engine.step()
    aborted = [o for o in outputs if o.request_id == "long"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert [o.request_id for o in outputs if not o.finished] == ["next"]  # took the slot at once
    assert aborted[0].metrics is not None


def test_invalid_requests_raise_clear_errors(model_dir):
    engine = make_engine(model_dir, max_model_len=64, kv_cache_tokens=48, max_waiting=1)
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("a", PROMPT, greedy(60))
    assert error.value.param == "max_tokens" and "64" in error.value.message
    with pytest.raises(InvalidRequestError, match="KV cache"):
        engine.add_request("b", PROMPT, greedy(45))
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("c", "", greedy())
    assert error.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        engine.add_request("d", [], greedy())
    with pytest.raises(InvalidRequestError):
        engine.add_request("e", [1, 2, 10**9], greedy())
    engine.add_request("f", [1, 2, 3], greedy(4))
    with pytest.raises(InvalidRequestError):
        engine.add_request("f", [1, 2, 3], greedy(4))
    with pytest.raises(QueueFullError):
        engine.add_request("g", [1, 2, 3], greedy(4))
    with pytest.raises(ValueError):
        SamplingParams(temperature=3.0)
    with pytest.raises(ValueError):
        SamplingParams(stop=[""])


def test_stats_and_request_metrics(model_dir):
    engine = make_engine(model_dir, max_batch_size=2)
    results = engine.generate([PROMPT, "hello", "a b c"], greedy(6))
    stats = engine.stats()
    assert stats.generation_tokens_total == 18
    assert stats.prompt_tokens_total == sum(
        len(engine.tokenizer.encode(p)) for p in (PROMPT, "hello", "a b c")
    )
    assert stats.num_running == stats.num_waiting == 0 and stats.num_slots_free == 2
    assert stats.kv_cache_usage == 0.0 and stats.num_steps > 0
    assert 0.5 < stats.slot_utilisation <= 1.0
    for result in results:
        m = result.metrics
        assert m is not None and 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
        assert len(m.inter_token_latencies) == 5
    # The third request waited for a slot: it queued longer than the first.
    waited, first = results[2].metrics, results[0].metrics
    assert waited is not None and first is not None and waited.queue_time > first.queue_time
