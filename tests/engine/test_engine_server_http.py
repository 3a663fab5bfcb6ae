"""A real `slotserve engine` on the tiny model, driven by the official openai client + raw HTTP."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from tests.engine.engine_server_support import EngineProcess, completion_body, sample
from tests.support import wait_until

MAX_MODEL_LEN = 2048
LONG = 2000  # tokens: far longer than any wait in these tests


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    proc = EngineProcess(
        tiny_model_dir,
        tmp_path_factory.mktemp("engine-http") / "engine.log",
        "--max-batch-size", "2",
        "--max-waiting", "1",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-request-body-bytes", "65536",
    )  # fmt: skip
    try:
        yield proc.start()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def idle(engine) -> bool:
    load = engine.get_json("/load")
    return load["running"] == 0 and load["waiting"] == 0


# ------------------------------------------------------------------------------ openai client


def test_completion_plain_and_streamed_agree(client, tokenizer):
    args = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    plain = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 12
    assert plain.usage.prompt_tokens == len(tokenizer("Once upon a time").input_ids)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 12
    assert plain.choices[0].text

    chunks = list(
        client.completions.create(
            **args,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == plain.choices[0].text
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == "length"
    assert set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_plain_and_streamed_agree(client, tokenizer):
    messages = [{"role": "user", "content": "Tell me a story."}]
    args = dict(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    plain = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    choice = plain.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    num_prompt = len(tokenizer(templated, add_special_tokens=False).input_ids)
    assert plain.usage.prompt_tokens == num_prompt
    assert plain.usage.completion_tokens == 10

    chunks = list(
        client.chat.completions.create(**args, stream=True, extra_body={"ignore_eos": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(chunk.usage is None for chunk in chunks)  # no usage chunk unless asked


def test_stop_string_cuts_the_answer(client):
    args = dict(model="tiny", prompt="The weather", max_tokens=24, temperature=0)
    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    cut = client.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]


def test_seeded_sampling_repeats(client):
    args = dict(model="tiny", prompt="Hi", max_tokens=8, temperature=1.0, seed=1234)
    first = client.completions.create(**args).choices[0].text
    assert client.completions.create(**args).choices[0].text == first


def test_model_list_and_slot_headers(client, engine):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    raw = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=1)
    assert raw.headers["x-slotserve-slots-total"] == "2"
    assert 0 <= int(raw.headers["x-slotserve-slots-free"]) <= 2
    load = engine.get_json("/load")
    assert load == {
        "model": "tiny",
        "policy": "continuous",
        "slots_total": 2,
        "slots_free": 2,
        "running": 0,
        "waiting": 0,
        "kv_cache_usage": load["kv_cache_usage"],
        "draining": False,
        "calibrations": load["calibrations"],
        "mean_request_seconds": load["mean_request_seconds"],
        "prefix_keys": [],  # a one-character prompt fills no 512-character block
        "prefix_cache_rows": 2,  # one KV row per slot: no spare rows by default
        "kv_cache_dtype": "float32",  # the suite pins it (tests/conftest.py)
        "max_batched_tokens": 1024,  # unset: a CPU's step budget
        "prefix_rows_free": load["prefix_rows_free"],
        "prefix_row_idle_ms": load["prefix_row_idle_ms"],
    }
    assert 0.0 <= load["kv_cache_usage"] <= 1.0
    # The completion above left its tokens in a row: at most one of the two rows is empty.
    assert 0 <= load["prefix_rows_free"] <= 1
    # While a row is empty a new prefix takes it (idle 0); else the row unused longest.
    assert (
        load["prefix_row_idle_ms"] == 0
        if load["prefix_rows_free"]
        else load["prefix_row_idle_ms"] > 0
    )
    # The completion above held a slot for a moment: the gateway's Retry-After reads this.
    assert load["mean_request_seconds"] > 0
    # linear_backend=auto was decided at load (measured, or read from the calibration cache):
    # up to how many rows the native kernels run, and oneDNN-or-aten when that is none.
    # And the native kernels' instruction set (avx512, avx2_fma or plain_c).
    names = [c["name"] for c in load["calibrations"]]
    assert names in (
        ["native_rows", "native_kernels"],
        ["native_rows", "linear_backend", "native_kernels"],
    )
    assert (len(names) == 2) == (load["calibrations"][0]["choice"] != "0")


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"'n' .3. exceeds this engine's 2 slots"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, n=3)


# ------------------------------------------------------------------------------ raw HTTP errors


async def post(engine, path: str, body, headers=None):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            engine.url + path, data=data, headers=headers or {"Content-Type": "application/json"}
        ) as resp,
    ):
        return resp.status, await resp.json(content_type=None), resp.headers


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b'{"model": "tiny", "prompt": "x",', 400, None, "invalid_json"),
        (b"[1, 2, 3]", 400, None, "invalid_json"),
        (b"\xff\xfe\x00 not text", 400, None, "invalid_json"),
        (b"[" * 5000 + b"]" * 5000, 400, None, "invalid_json"),
        (
            b'{"model": "tiny", "prompt": "x", "temperature": NaN}',
            400,
            "temperature",
            "invalid_value",
        ),
        (
            b'{"model": "tiny", "prompt": "x", "max_tokens": 1e309}',
            400,
            "max_tokens",
            "invalid_value",
        ),
        (
            {"model": "tiny", "prompt": "x", "stop_token_ids": [-1]},
            400,
            "stop_token_ids",
            "invalid_value",
        ),
        (
            {"model": "tiny", "prompt": "x", "temperature": "hot"},
            400,
            "temperature",
            "invalid_value",
        ),
        ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
        ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p", "invalid_value"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature", "invalid_value"),
        ({"model": "tiny", "prompt": "x", "n": 3}, 400, "n", "invalid_value"),
        ({"model": "tiny", "prompt": "x", "logprobs": 6}, 400, "logprobs", "invalid_value"),
        ({"model": "tiny", "prompt": "x", "bogus": 1}, 400, "bogus", "unsupported_parameter"),
        ({"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
        ({"model": "tiny", "prompt": "x" * 70_000}, 413, None, "request_too_large"),
    ],
)
async def test_completion_errors_in_openai_shape(engine, body, status, param, code):
    got, payload, headers = await post(engine, "/v1/completions", body)
    assert got == status, payload
    assert headers["x-slotserve-slots-total"] == "2"  # capacity rides on refusals too
    error = payload["error"]
    assert error["message"]
    assert error["type"]
    assert error["param"] == param
    assert error["code"] == code


async def test_chunked_body_beyond_the_limit_is_413(engine):
    async def chunks():
        for _ in range(100):
            yield b"x" * 1024  # 100 KiB without a Content-Length

    async with (
        aiohttp.ClientSession() as session,
        session.post(engine.url + "/v1/completions", data=chunks()) as resp,
    ):
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "prompt",
    [
        "word " * (MAX_MODEL_LEN + 10),  # prompt alone beyond the model length
        [1] * (MAX_MODEL_LEN - 5),  # prompt + max_tokens beyond it
        [10**9],  # not a token of this vocabulary
        [],  # empty
    ],
)
async def test_prompts_the_model_cannot_take_are_400(engine, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16}
    got, payload, _ = await post(engine, "/v1/completions", body)
    assert got == 400, payload
    assert payload["error"]["type"] == "invalid_request_error"


async def test_chat_errors_name_the_field(engine):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    got, payload, _ = await post(engine, "/v1/chat/completions", {**base, "tools": [{"x": 1}]})
    assert (got, payload["error"]["param"]) == (400, "tools.0.type")  # a tool's first field
    got, payload, _ = await post(engine, "/v1/chat/completions", {**base, "messages": []})
    assert (got, payload["error"]["param"]) == (400, "messages")
    got, payload, _ = await post(
        engine, "/v1/chat/completions", {**base, "max_completion_tokens": 0}
    )
    assert (got, payload["error"]["param"]) == (400, "max_completion_tokens")


async def test_unknown_routes_and_methods_answer_json(engine):
    async with aiohttp.ClientSession() as session:
        async with session.get(engine.url + "/v1/completions") as resp:
            assert resp.status == 405
            assert "error" in await resp.json()
        async with session.post(engine.url + "/v1/embeddings", json={}) as resp:
            assert resp.status == 404
            assert "error" in await resp.json()
    assert engine.status("/health") == 200  # nothing a client sends takes it down


# ------------------------------------------------------------------------------ load, abort, 429


async def load(session, engine) -> dict:
    async with session.get(engine.url + "/load") as resp:
        return await resp.json()


async def wait_load(session, engine, timeout: float, **expected) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        current = await load(session, engine)
        if all(current[key] == value for key, value in expected.items()):
            return current
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"/load never reached {expected}: {current}")
        await asyncio.sleep(0.02)


async def test_disconnected_stream_is_aborted(engine):
    wait_until(lambda: idle(engine), timeout=10)
    before = engine.metrics()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            engine.url + "/v1/completions", json=completion_body(LONG, stream=True)
        )
        assert resp.status == 200
        assert resp.headers["x-slotserve-slots-total"] == "2"
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        await wait_load(session, engine, 5, running=1)
        resp.close()  # the client goes away mid-stream
        await wait_load(session, engine, 3, running=0, slots_free=2)
    after = engine.metrics()
    generated = sample(after, "vllm:generation_tokens_total", model_name="tiny") - sample(
        before, "vllm:generation_tokens_total", model_name="tiny"
    )
    assert 0 < generated < LONG
    aborts = "vllm:request_success_total"
    assert sample(after, aborts, model_name="tiny", finished_reason="abort") == (
        sample(before, aborts, model_name="tiny", finished_reason="abort") + 1
    )


async def test_disconnected_plain_request_is_aborted(engine):
    wait_until(lambda: idle(engine), timeout=10)
    async with aiohttp.ClientSession() as session:
        pending = asyncio.create_task(
            session.post(engine.url + "/v1/completions", json=completion_body(LONG, stream=False))
        )
        await wait_load(session, engine, 5, running=1)
        pending.cancel()  # closes the connection before any answer
        with pytest.raises(asyncio.CancelledError):
            await pending
        await wait_load(session, engine, 3, running=0, slots_free=2)


async def test_full_waiting_queue_is_429_with_retry_after(engine):
    wait_until(lambda: idle(engine), timeout=10)
    async with aiohttp.ClientSession() as session:
        blockers = []
        for expected in ({"running": 1}, {"running": 2}, {"running": 2, "waiting": 1}):
            blockers.append(
                asyncio.create_task(
                    session.post(
                        engine.url + "/v1/completions", json=completion_body(LONG, stream=False)
                    )
                )
            )
            await wait_load(session, engine, 5, **expected)
        try:
            status, payload, headers = await post(
                engine, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}
            )
            assert status == 429, payload
            assert payload["error"]["code"] == "queue_full"
            assert int(headers["Retry-After"]) >= 1
            assert headers["x-slotserve-slots-free"] == "0"
        finally:
            for blocker in blockers:
                blocker.cancel()
            await asyncio.gather(*blockers, return_exceptions=True)
        await wait_load(session, engine, 5, running=0, waiting=0)


# ------------------------------------------------------------------------------ metrics


def test_metrics_move_by_exact_amounts(engine, client, tokenizer):
    wait_until(lambda: idle(engine), timeout=10)
    prompt = tokenizer("the quick brown fox jumps").input_ids
    num_new = 6
    before = engine.metrics()
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=num_new, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == num_new
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    after = engine.metrics()

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    tiny = {"model_name": "tiny"}
    assert delta("vllm:prompt_tokens_total", **tiny) == len(prompt)
    assert delta("vllm:generation_tokens_total", **tiny) == num_new
    assert delta("vllm:request_success_total", finished_reason="length", **tiny) == 1
    assert delta("vllm:time_to_first_token_seconds_count", **tiny) == 1
    assert delta("vllm:inter_token_latency_seconds_count", **tiny) == num_new - 1
    assert delta("vllm:e2e_request_latency_seconds_count", **tiny) == 1
    assert delta("vllm:request_queue_time_seconds_count", **tiny) == 1
    assert delta("vllm:e2e_request_latency_seconds_sum", **tiny) > 0
    assert delta("slotserve_requests_rejected_total", reason="unknown_model") == 1
    assert sample(after, "vllm:num_requests_running", **tiny) == 0
    assert sample(after, "vllm:num_requests_waiting", **tiny) == 0
    assert sample(after, "slotserve_slots_total", **tiny) == 2
    assert sample(after, "slotserve_slots_free", **tiny) == 2
    assert sample(after, "slotserve_policy_info", policy="continuous", **tiny) == 1
    assert sample(after, "slotserve_draining") == 0
    assert 0 < sample(after, "slotserve_slot_utilisation", **tiny) <= 1
