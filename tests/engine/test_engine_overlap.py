"""Overlapped static decode steps (issue 30): step N+1 is launched, its input tokens taken on
the device from step N's, before the host postprocesses step N. The outputs a client sees are
the same as without overlap (tokens, text, finish reasons, counts), through stop tokens, stop
strings, max_tokens, aborts, penalties, seeded sampling and arrivals; and a chained step does
no host-device transfer but the allowed ones."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.model.host_sync import HostSyncCounter
from slotserve.engine.core.params import SamplingParams
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    hf_greedy,
    make_engine,
    make_prompts,
    run_staggered,
)

NUM_NEW = 24


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-overlap", smollm2_dir)


@pytest.fixture(scope="module")
def reference_model(sharp_model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(sharp_model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def overlapped(model_dir, **settings):
    engine = make_engine(model_dir, decode_step="static", overlap_steps="on", **settings)
    assert engine.overlap is not None
    return engine


def drive(engine, requests, *, every=1, abort_after=None):
    """Add ``requests`` ((id, prompt, params)) one every ``every`` steps; step to the end.
    Returns, per request id, what a client saw: token ids, text, finish reason, and the last
    output's token count. ``abort_after``: {id: n} aborts a request once n tokens came out."""
    seen: dict[str, dict[str, Any]] = {
        request_id: {"ids": [], "text": "", "reason": None} for request_id, *_ in requests
    }
    pending, step = list(requests), 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            engine.add_request(*pending.pop(0))
        for output in engine.step():
            entry = seen[output.request_id]
            assert entry["reason"] is None, f"{output.request_id} had output after it finished"
            entry["ids"] += output.token_ids
            entry["text"] += output.text
            entry["generated"] = output.num_generated_tokens
            if output.finished:
                entry["reason"] = output.finish_reason
            limit = (abort_after or {}).get(output.request_id)
            if limit is not None and len(entry["ids"]) >= limit and not output.finished:
                engine.abort(output.request_id)
        step += 1
        assert step < 3000, "the engine did not finish"
    return seen


def test_overlapped_steps_equal_generate_under_arrivals_and_preemption(
    sharp_model_dir, reference_model
):
    prompts = make_prompts(14)
    engine = overlapped(
        sharp_model_dir, max_batch_size=6, max_batched_tokens=32, kv_cache_tokens=260
    )
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    seqs = run_staggered(engine, prompts, params, every=7, per=3)
    assert engine.stats().num_preemptions > 0
    assert engine.overlap.num_chained > 20  # decode steps launched ahead while none waited
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.generated_token_ids == hf_greedy(reference_model, prompt, NUM_NEW), (
            seq.request_id
        )
    stats = engine.stats()
    assert stats.generation_tokens_total == len(prompts) * NUM_NEW
    assert engine.kv_cache.num_tokens_used == 0 and engine.kv_cache.num_free_slots == 6


def test_stops_lengths_and_aborts_give_what_the_plain_step_gives(sharp_model_dir):
    """Stop tokens and stop strings end a sequence one step after its next row was launched:
    that row's token is dropped (never emitted, never counted)."""
    prompts = make_prompts(6, seed=2)
    plain = make_engine(sharp_model_dir, max_batch_size=6, decode_step="static")
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free_run = {
        i: seq.generated_token_ids
        for i, seq in enumerate(run_staggered(plain, prompts, greedy, every=1, per=6))
    }
    texts = {i: plain.tokenizer.decode(ids) for i, ids in free_run.items()}
    # A stop token met by the 20th token, a stop string from the 20th token's text (met there
    # or sooner), a short max_tokens, min_tokens holding EOS back, and two left to their full
    # length, one of them aborted. All six fit in the slots: nothing waits, so decode steps
    # chain once the last has arrived, and the stops fall in chained steps.
    stop_string = texts[1][len(plain.tokenizer.decode(free_run[1][:19])) :][:3]
    assert stop_string.strip(), "the stop string must be visible text"
    cases = [
        greedy.model_copy(update={"stop_token_ids": [free_run[0][19]]}),
        greedy.model_copy(update={"stop": [stop_string]}),
        greedy.model_copy(update={"max_tokens": 5}),
        greedy.model_copy(update={"min_tokens": 7, "ignore_eos": False}),
        greedy,
        greedy.model_copy(update={"max_tokens": 40}),
    ]
    requests = [
        (f"q{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, cases, strict=True))
    ]
    abort_after = {"q5": 8}
    seen = {}
    for mode in ("plain", "overlap"):
        if mode == "overlap":
            engine = overlapped(sharp_model_dir, max_batch_size=6)
        else:
            engine = make_engine(sharp_model_dir, max_batch_size=6, decode_step="static")
        seen[mode] = drive(engine, requests, every=3, abort_after=abort_after)
        assert engine.kv_cache.num_tokens_used == 0
        generated = sum(len(entry["ids"]) for entry in seen[mode].values())
        assert engine.stats().generation_tokens_total == generated
        if mode == "overlap":
            assert engine.overlap.num_chained > 20
            # The rows launched after the stop token's, the stop string's and the abort's step.
            assert engine.overlap.num_dropped_rows >= 3
    assert seen["overlap"] == seen["plain"]
    got = seen["overlap"]
    assert got["q0"]["reason"] == "stop" and len(got["q0"]["ids"]) <= 20
    assert got["q1"]["reason"] == "stop" and stop_string not in got["q1"]["text"]
    assert got["q2"]["reason"] == "length" and len(got["q2"]["ids"]) == 5
    assert got["q5"]["reason"] == "abort" and 8 <= len(got["q5"]["ids"]) < 40
    # An aborted request's tokens are the start of what it would have said.
    aborted = got["q5"]["ids"]
    assert (
        aborted
        == run_staggered(plain, [prompts[5]], cases[5], every=1, per=1)[0].generated_token_ids[
            : len(aborted)
        ]
    )


def test_penalties_seeds_and_logprobs_are_the_plain_steps(sharp_model_dir, tiny_model_dir):
    kinds = [
        SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=2.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=11, ignore_eos=True),
        SamplingParams(
            max_tokens=17,
            temperature=0.0,
            frequency_penalty=2.0,
            presence_penalty=1.5,
            ignore_eos=True,
            logprobs=2,
        ),
        SamplingParams(max_tokens=10, temperature=1.2, top_k=20, seed=5, ignore_eos=True),
    ]
    prompts = make_prompts(8, seed=4)
    for model_dir in (tiny_model_dir, sharp_model_dir):  # the tiny one echoes: penalties bite
        requests = [(f"p{i}", p, kinds[i % 4]) for i, p in enumerate(prompts)]
        plain = make_engine(model_dir, max_batch_size=3, decode_step="static")
        engine = overlapped(model_dir, max_batch_size=3)
        assert drive(engine, requests, every=2) == drive(plain, requests, every=2)
        assert engine.overlap.num_chained > 10
        static = engine.runner.static
        assert any(full for (_rows, _span, full) in static.stats.steps_per_bucket)


def test_a_chained_step_does_only_the_allowed_transfers(sharp_model_dir):
    engine = overlapped(sharp_model_dir, max_batch_size=4)
    static = engine.runner.static
    mixed = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=40, ignore_eos=True),
        SamplingParams(
            max_tokens=11, temperature=1.0, seed=3, logprobs=2, ignore_eos=True, stop=["zz"]
        ),
    ]
    for i, prompt in enumerate(make_prompts(4)):
        engine.add_request(f"s{i}", prompt, mixed[i % 3])
    num_chained = 0
    while engine.has_unfinished():
        before = (engine.overlap.num_chained, static.transfers.num_to_device)
        to_host = static.transfers.num_to_host
        with HostSyncCounter(static.transfers) as counter:
            engine.step()
        if engine.overlap.num_chained == before[0]:
            continue  # a prefill step, or the last collect
        num_chained += 1
        # One copy in (the chained step's), one result read (the previous step's).
        assert counter.others == [], counter.others
        assert static.transfers.num_to_device == before[1] + 1
        assert static.transfers.num_to_host == to_host + 1
        assert counter.allowed <= 2
    assert num_chained > 5


def test_the_setting_needs_the_static_step(sharp_model_dir):
    from slotserve.engine.core.model.loader import pick_overlap_steps

    with pytest.raises(UnsupportedSettingError, match="overlap_steps"):
        make_engine(sharp_model_dir, decode_step="classic", overlap_steps="on")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_overlap_steps("auto", "compiled", cuda)
    assert not pick_overlap_steps("auto", "compiled", cpu)
    assert not pick_overlap_steps("auto", "static", cuda)
    assert not pick_overlap_steps("off", "compiled", cuda)
    assert make_engine(sharp_model_dir, decode_step="static").overlap is None


def test_the_real_model_ends_on_its_own_eos_the_same_way(smollm2_dir):
    """SmolLM2-135M-Instruct, chat prompts, its own EOS (<|im_end|>) and a stop string: the
    overlapped engine's answers are the plain static step's, word for word."""
    plain = make_engine(smollm2_dir, max_batch_size=3, decode_step="static")
    questions = ["What is the capital of France?", "Say hi.", "Name three colours."]
    prompts = [
        plain.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        for question in questions
    ]
    params = [
        SamplingParams(max_tokens=48, temperature=0.0),
        SamplingParams(max_tokens=48, temperature=0.0),
        SamplingParams(max_tokens=48, temperature=0.0, stop=[","]),
    ]
    requests = [
        (f"c{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
    ]
    engine = overlapped(smollm2_dir, max_batch_size=3)
    got = drive(engine, requests)
    assert got == drive(plain, requests)
    reasons = {entry["reason"] for entry in got.values()}
    assert reasons <= {"stop", "length"} and "stop" in reasons
    assert engine.overlap.num_chained > 5 and engine.overlap.num_dropped_rows >= 1


async def test_the_async_loop_streams_overlapped_steps(sharp_model_dir):
    """The server's loop thread over an overlapped engine: a step in flight keeps the loop
    stepping, and the streams are the plain static step's."""
    from slotserve.engine.core.async_engine import AsyncEngine

    prompts = make_prompts(5, seed=6)
    params = SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True, stop=["ab"])
    expected = make_engine(sharp_model_dir, max_batch_size=4, decode_step="static").generate(
        prompts, params
    )
    engine = AsyncEngine(overlapped(sharp_model_dir, max_batch_size=4))
    await engine.start()
    try:
        streams = [engine.add_request(f"a{i}", p, params) for i, p in enumerate(prompts)]

        async def collect(stream):
            return [output async for output in stream]

        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
    finally:
        await engine.shutdown()
    for outputs, reference in zip(results, expected, strict=True):
        assert [t for o in outputs for t in o.token_ids] == reference.token_ids
        assert "".join(o.text for o in outputs) == reference.text
        assert outputs[-1].finish_reason == reference.finish_reason
    overlap = engine.engine.overlap
    assert overlap is not None and overlap.num_chained > 5
