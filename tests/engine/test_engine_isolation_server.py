"""Fault isolation seen from HTTP: a real `slotserve engine` process, and the app in process.

The process serves a tiny model whose input embedding of one word is NaN (a fault injected in
the real weights): any request that reads the word gets NaN logits and must fail alone, with
OpenAI's error shape and a status that says whose fault it is, while its neighbours' answers
stay exactly what they are without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from slotserve.engine.settings import EngineSettings
from tests.engine.engine_core_support import TOKENIZER_FILES, build_sharp_tiny_model
from tests.engine.engine_server_support import EngineProcess, json_event, sample

POISONED_WORD = " zebra"
PROMPTS = ["Once upon a time", "The capital of France", "1, 2, 3,", "def main():"]
TIMEOUT = aiohttp.ClientTimeout(total=120)


@pytest.fixture(scope="module")
def poisoned_model_dir(tmp_path_factory, smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(str(base))
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    with torch.no_grad():  # untied output head: only sequences that READ the word fail
        for token_id in tokenizer.encode(POISONED_WORD, add_special_tokens=False):
            # transformers types from_pretrained's result as a class without the embedding
            # accessors (read as an nn.Module attribute), though every causal LM has them.
            model.get_input_embeddings().weight[token_id] = float("nan")  # type: ignore[operator]
    dest = tmp_path_factory.mktemp("poisoned") / "model"
    model.save_pretrained(str(dest))
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def engine(poisoned_model_dir, tmp_path_factory):
    proc = EngineProcess(
        poisoned_model_dir,
        tmp_path_factory.mktemp("engine-isolation") / "engine.log",
        "--max-batch-size", "8",
        "--max-model-len", "512",
    )  # fmt: skip
    try:
        yield proc.start()
    finally:
        proc.stop()


def body(prompt: str, *, stream: bool, max_tokens: int = 32, temperature: float = 0.0) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": stream,
    }


async def read_events(resp: aiohttp.ClientResponse) -> list[dict | str]:
    """Every SSE data payload: parsed JSON, or the string "[DONE]"."""
    events: list[dict | str] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :].strip()
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


async def streamed_text(session, url: str, payload: dict, started: asyncio.Event | None = None):
    """(text, finish_reason, events) of one streamed completion."""
    async with session.post(url + "/v1/completions", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        events: list[dict | str] = []
        async for line in resp.content:
            if line.startswith(b"data: "):
                payload_bytes = line[len(b"data: ") :].strip()
                events.append("[DONE]" if payload_bytes == b"[DONE]" else json.loads(payload_bytes))
                if started is not None:
                    started.set()
    choices = [c for e in events if isinstance(e, dict) for c in e.get("choices", [])]
    text = "".join(c["text"] for c in choices)
    finish = [c["finish_reason"] for c in choices if c["finish_reason"]]
    return text, finish, events


async def references(session, url: str, max_tokens: int = 32) -> list[str]:
    """Each prompt alone (one at a time): what it must get whatever runs beside it."""
    texts = []
    for prompt in PROMPTS:
        async with session.post(
            url + "/v1/completions", json=body(prompt, stream=False, max_tokens=max_tokens)
        ) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
            assert answer["choices"][0]["finish_reason"] == "length"
            texts.append(answer["choices"][0]["text"])
    return texts


async def test_tiny_temperature_beside_four_greedy_streams(engine):
    """The reported scenario: `temperature: 1e-40` beside four greedy streams killed all five
    (the bad request was then retried on up to 3 more engines)."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        expected = await references(session, engine.url, max_tokens=48)
        started = asyncio.Event()
        greedy = [
            asyncio.create_task(
                streamed_text(session, engine.url, body(p, stream=True, max_tokens=48), started)
            )
            for p in PROMPTS
        ]
        await asyncio.wait_for(started.wait(), 60)  # the four are running
        tiny = await asyncio.wait_for(
            streamed_text(
                session, engine.url, body("tell me", stream=True, temperature=1e-40, max_tokens=8)
            ),
            60,
        )
        results = await asyncio.wait_for(asyncio.gather(*greedy), 120)
    assert tiny[1] == ["length"] and tiny[2][-1] == "[DONE]"  # below the epsilon: greedy
    for (text, finish, events), reference in zip(results, expected, strict=True):
        assert finish == ["length"] and events[-1] == "[DONE]"
        assert text == reference


async def test_nan_logits_fail_that_request_only_with_openai_errors(engine):
    bad_prompt = f"The{POISONED_WORD} ran away"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        expected = await references(session, engine.url)
        before = engine.metrics()
        started = asyncio.Event()
        greedy = [
            asyncio.create_task(streamed_text(session, engine.url, body(p, stream=True), started))
            for p in PROMPTS
        ]
        await asyncio.wait_for(started.wait(), 60)
        # Streamed: the status line is sent, so the failure is an SSE error event, no [DONE].
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": bad_prompt}],
            "max_tokens": 8,
            "stream": True,
        }
        async with session.post(engine.url + "/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200
            events = await asyncio.wait_for(read_events(resp), 60)
        # Not streamed: 500 with OpenAI's error body (the request's own failure, not overload).
        async with session.post(
            engine.url + "/v1/completions", json=body(bad_prompt, stream=False)
        ) as resp:
            plain_status, plain = resp.status, await resp.json()
        results = await asyncio.wait_for(asyncio.gather(*greedy), 120)

    assert "[DONE]" not in events
    request_id = json_event(events[0])["id"]  # the role chunk, sent before the first step
    error = json_event(events[-1])["error"]
    assert error["type"] == "server_error" and error["code"] == "non_finite_logits"
    assert set(error) == {"message", "type", "param", "code"}
    assert plain_status == 500
    assert plain["error"]["code"] == "non_finite_logits" and plain["error"]["message"]

    for (text, finish, greedy_events), reference in zip(results, expected, strict=True):
        assert finish == ["length"] and greedy_events[-1] == "[DONE]"
        assert text == reference, "a neighbour's answer changed beside a failing request"

    assert engine.status("/health") == 200 and engine.status("/ready") == 200
    after = engine.metrics()
    name = "slotserve_sequence_failures_total"
    failed = sample(after, name, model_name="tiny", reason="non_finite_logits") - sample(
        before, name, model_name="tiny", reason="non_finite_logits"
    )
    assert failed == 2
    assert sample(after, "slotserve_engine_step_failures_total", model_name="tiny") == 0
    errors = sample(after, "vllm:request_success_total", model_name="tiny", finished_reason="error")
    assert errors >= 2
    # The log names the failed request, never its prompt.
    logs = engine.log_path.read_text(errors="replace")
    assert f"request {request_id} failed (non_finite_logits)" in logs
    assert "zebra" not in logs and "ran away" not in logs


@contextlib.asynccontextmanager
async def ready_tiny_server(tiny_model_dir) -> AsyncIterator[tuple[Any, TestClient]]:
    """An in-process engine on the tiny model behind its HTTP app, once /ready says so."""
    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.http.server import create_app

    settings = EngineSettings(
        model=str(tiny_model_dir), served_model_name="tiny", num_threads=1, max_model_len=512
    )
    engine = await asyncio.to_thread(AsyncEngine.load, settings)
    client = TestClient(TestServer(create_app(engine)))
    await client.start_server()
    try:
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.05)
        yield engine, client
    finally:
        await client.close()


async def test_a_broken_runner_fails_probes_and_ends_streams_retryably(tiny_model_dir):
    """A step that raises (a device error) ends every request with a retryable 503-class
    error, fails /health and /ready so Kubernetes restarts the pod, and is counted."""
    async with ready_tiny_server(tiny_model_dir) as (engine, client):
        streamed = await client.post("/v1/completions", json=body("a", stream=True, max_tokens=400))
        assert (await streamed.content.readline()).startswith(b"data: ")
        plain = asyncio.create_task(
            client.post("/v1/completions", json=body("b", stream=False, max_tokens=400))
        )
        # Both must be the engine's before the step fails: a fixed 0.2 s once left "b" in the
        # tokenizer (its worker runs at nice 19) on a busy machine, so it was refused instead.
        for _ in range(600):
            stats = engine.stats()
            if stats.num_running + stats.num_waiting >= 2:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the second request never reached the engine")

        def device_error(chunks):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        engine.engine.runner.execute = device_error
        events = await asyncio.wait_for(read_events(streamed), 30)
        assert (
            json_event(events[-1])["error"]["code"] == "engine_failure" and "[DONE]" not in events
        )
        resp = await asyncio.wait_for(plain, 30)
        assert resp.status == 503 and resp.headers["Retry-After"]
        assert (await resp.json())["error"]["code"] == "engine_failure"

        for path in ("/health", "/ready"):
            resp = await client.get(path)
            assert resp.status == 503, path
            assert (await resp.json())["error"]["code"] == "engine_failure"
        resp = await client.post("/v1/completions", json=body("c", stream=False))
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "engine_failure"
        metrics = await (await client.get("/metrics")).text()
        assert 'slotserve_engine_step_failures_total{model_name="tiny"} 1.0' in metrics
        assert (
            'slotserve_sequence_failures_total{model_name="tiny",reason="engine_failure"} 2.0'
            in metrics
        )


async def test_a_request_racing_the_failure_is_told_the_engine_broke(tiny_model_dir, monkeypatch):
    """A request that passed the readiness check just before a step failed meets a stopped
    loop: it gets the same retryable engine_failure answer, with Retry-After (it once got a
    bare 'draining' 503 the gateway could not act on)."""
    from slotserve.engine.http import openai_routes

    async with ready_tiny_server(tiny_model_dir) as (engine, client):
        streamed = await client.post("/v1/completions", json=body("a", stream=True, max_tokens=400))

        def device_error(chunks):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        engine.engine.runner.execute = device_error
        await asyncio.wait_for(read_events(streamed), 30)
        assert engine.failure is not None
        # The race: the route's readiness check ran before the failure was recorded.
        monkeypatch.setattr(openai_routes, "accepting_engine", lambda state: engine)
        resp = await client.post("/v1/completions", json=body("b", stream=False))
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "engine_failure"
