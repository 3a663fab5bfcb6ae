"""AsyncEngine: concurrent streams, abort, shutdown, errors at once, a free event loop."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from slotserve.engine.core import async_engine
from slotserve.engine.core.async_engine import AsyncEngine
from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.errors import EngineNotRunningError, InvalidRequestError, QueueFullError
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.settings import EngineSettings
from tests.engine.engine_core_support import build_sharp_tiny_model, make_engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


@pytest.fixture
async def engine(model_dir):
    engine = AsyncEngine(make_engine(model_dir, max_batch_size=4, max_waiting=8))
    await engine.start()
    yield engine
    await engine.shutdown()


def greedy(max_tokens=16, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def collect(stream):
    outputs = [output async for output in stream]
    return outputs


async def test_concurrent_streams_match_the_sync_engine(engine, model_dir):
    prompts = [f"request number {i} says hello" for i in range(6)]
    streams = [engine.add_request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
    expected = make_engine(model_dir, max_batch_size=1).generate(prompts, greedy(12))
    for outputs, reference in zip(results, expected, strict=True):
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert all(not o.finished for o in outputs[:-1])
        assert [t for o in outputs for t in o.token_ids] == reference.token_ids
        assert "".join(o.text for o in outputs) == reference.text
        assert outputs[-1].num_generated_tokens == 12 and outputs[-1].metrics is not None
    stats = engine.stats()
    assert stats.generation_tokens_total == 72 and stats.num_slots_total == 4


async def test_abort_ends_the_stream_and_frees_the_slot(engine):
    stream = engine.add_request("long", "tell me a long story", greedy(400))
    first = await asyncio.wait_for(stream.__anext__(), 30)
    assert not first.finished
    engine.abort("long")
    engine.abort("long")
    rest = await asyncio.wait_for(collect(stream), 30)
    assert rest[-1].finish_reason == "abort" and rest[-1].num_generated_tokens < 400
    await asyncio.sleep(0.05)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_slots_free == 4


async def test_errors_are_raised_at_once(engine, model_dir):
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", "x", greedy(10_000))
    engine.add_request("dup", "x", greedy(50))
    with pytest.raises(InvalidRequestError):
        engine.add_request("dup", "x", greedy(5))
    idle = AsyncEngine(make_engine(model_dir))
    with pytest.raises(EngineNotRunningError):
        idle.add_request("a", "x", greedy())


async def test_queue_full_beyond_max_waiting(model_dir):
    engine = AsyncEngine(make_engine(model_dir, max_batch_size=1, max_waiting=2))
    await engine.start()
    try:
        streams = [engine.add_request(f"r{i}", "hi", greedy(400)) for i in range(3)]
        for _ in range(500):  # until the loop thread has taken them over: 1 running, 2 waiting
            stats = engine.stats()
            if stats.num_running == 1 and stats.num_waiting == 2:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError):
            engine.add_request("r3", "hi", greedy(30))
        for i, stream in enumerate(streams):
            engine.abort(f"r{i}")
            assert (await asyncio.wait_for(collect(stream), 30))[-1].finish_reason == "abort"
    finally:
        await engine.shutdown()


async def test_shutdown_ends_open_streams_with_abort(model_dir):
    engine = AsyncEngine(make_engine(model_dir, max_batch_size=1))
    await engine.start()
    streams = [engine.add_request(f"r{i}", "hello there", greedy(500)) for i in range(3)]
    await asyncio.wait_for(streams[0].__anext__(), 30)
    await asyncio.wait_for(engine.shutdown(), 30)
    for stream in streams:
        outputs = await asyncio.wait_for(collect(stream), 5)
        assert outputs[-1].finish_reason == "abort"
    with pytest.raises(EngineNotRunningError):
        engine.add_request("late", "x", greedy())


async def test_event_loop_stays_responsive_while_generating(engine):
    # Requests back to back for at least half a second: one 150-token request on the tiny model
    # can finish within ten 5 ms sleeps now that decode steps run natively.
    lags = []
    started = time.perf_counter()
    for number in itertools.count():
        if time.perf_counter() - started > 0.5:
            break
        stream = engine.add_request(f"busy{number}", "keep the engine busy", greedy(150))
        consumer = asyncio.create_task(collect(stream))
        while not consumer.done():
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - start - 0.005)
    assert len(lags) > 10
    assert sorted(lags)[len(lags) // 2] < 0.05  # the loop thread never blocks the event loop


def _recording_engine(model_dir) -> AsyncEngine:
    settings = EngineSettings(
        model=str(model_dir), max_model_len=512, num_threads=1, max_batch_size=8, max_waiting=8
    )
    return AsyncEngine(LLMEngine.load(settings, record_steps=True))


async def test_a_burst_sent_to_an_idle_engine_is_prefilled_in_one_step(model_dir, monkeypatch):
    # The hold's bound raised, so that a loaded machine's slow tokenizing cannot end it: the
    # first step waits for every prompt of the burst still being tokenized.
    monkeypatch.setattr(async_engine, "GATHER_SECONDS", 30.0)
    engine = _recording_engine(model_dir)
    await engine.start()
    try:

        async def send(i: int):
            ids = await engine.prompts.encode(f"request {i}: " + "tell me more " * 10)
            return engine.add_request(f"r{i}", ids, greedy(4))

        streams = await asyncio.wait_for(asyncio.gather(*(send(i) for i in range(6))), 60)
        await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        first = engine.engine.step_records[0]
        assert sorted(first.slots.values()) == [f"r{i}" for i in range(6)]
    finally:
        await engine.shutdown()


async def test_a_lone_request_and_a_running_batch_are_never_held(model_dir, monkeypatch):
    monkeypatch.setattr(async_engine, "GATHER_SECONDS", 30.0)
    engine = _recording_engine(model_dir)
    await engine.start()
    try:
        # Nothing else is being tokenized: the first step starts at once.
        start = time.monotonic()
        await asyncio.wait_for(collect(engine.add_request("lone", "hello there", greedy(2))), 20)
        assert time.monotonic() - start < 10
        # A batch decoding while a prompt is being tokenized keeps stepping.
        running = engine.add_request("running", "tell me a long story", greedy(300))
        first = await asyncio.wait_for(running.__anext__(), 20)
        assert not first.finished
        steps_before = len(engine.engine.step_records)
        # The tokenizer's worker busy for a while (as with a long prompt): the next prompt is in
        # flight meanwhile.
        engine.prompts._pool().submit(time.sleep, 2.0)
        task = asyncio.ensure_future(engine.prompts.encode("a short prompt"))
        while engine.prompts.in_flight == 0 and not task.done():
            await asyncio.sleep(0.001)
        stepped = False
        while engine.prompts.in_flight and not stepped:
            stepped = len(engine.engine.step_records) >= steps_before + 3
            await asyncio.sleep(0.005)
        assert stepped, "the running batch stood still while a prompt was being tokenized"
        assert await asyncio.wait_for(task, 60)
        engine.abort("running")
    finally:
        await engine.shutdown()


async def test_only_prompts_on_their_way_to_the_engine_are_in_flight(model_dir):
    # /tokenize's prompts (for_engine=False) never make an idle engine wait.
    engine = _recording_engine(model_dir)
    await engine.start()
    try:
        engine.prompts._pool().submit(time.sleep, 1.0)  # the worker busy: both calls queue
        counted = asyncio.ensure_future(engine.prompts.encode("for the engine"))
        not_counted = asyncio.ensure_future(
            engine.prompts.encode("for /tokenize", for_engine=False)
        )
        await asyncio.sleep(0.2)
        assert not counted.done() and not not_counted.done()
        assert engine.prompts.in_flight == 1
        assert await asyncio.wait_for(counted, 30) and await asyncio.wait_for(not_counted, 30)
        assert engine.prompts.in_flight == 0
    finally:
        await engine.shutdown()
