"""Each answer's usage names the prompt tokens its slot row already held (OpenAI's
``prompt_tokens_details.cached_tokens``; the Responses API's ``input_tokens_details``).

A real engine on the tiny model over HTTP: a conversation's first turn reuses nothing, its next
turn reuses its history, and every figure equals what the engine's own prefix-cache counter
(``vllm:prefix_cache_hits``) moved by for that request; streamed usage, ``n`` choices (the prompt
counted once) and the Responses API report the same.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.engine.engine_core_support import served_in_process


@pytest.fixture
async def client(tiny_model_dir) -> AsyncIterator[TestClient]:
    rows = {"max_batch_size": 2, "prefix_cache_rows": 4, "max_model_len": 512}
    async with served_in_process(tiny_model_dir, **rows) as client:
        yield client


async def hits(client: TestClient) -> int:
    text = await (await client.get("/metrics")).text()
    match = re.search(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    assert match is not None, text
    return int(float(match.group(1)))


async def post(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json={"model": "tiny", "temperature": 0, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def streamed_usage(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}, **body},
    )  # fmt: skip
    assert resp.status == 200, await resp.text()
    usages = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            event = json.loads(line[len(b"data: ") :])
            if event.get("usage"):
                usages.append(event["usage"])
    assert len(usages) == 1
    return usages[0]


async def test_a_conversations_next_turn_reports_its_history_as_cached(client):
    turn = [{"role": "user", "content": "Name three colours of the sea at dawn, please."}]
    before = await hits(client)
    first = await post(client, "/v1/chat/completions", {"messages": turn, "max_tokens": 6})
    usage = first["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert await hits(client) == before
    answer = first["choices"][0]["message"]["content"]
    turn += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And at dusk?"},
    ]
    before = await hits(client)
    second = await post(client, "/v1/chat/completions", {"messages": turn, "max_tokens": 6})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The history up to where the template renders the answer (its first tokens may merge with
    # the generation prompt's last one differently), never the new message.
    assert usage["prompt_tokens"] // 2 < cached < second["usage"]["prompt_tokens"]
    assert await hits(client) - before == cached

    # The same prompt again, streamed: all of it but the last token comes from the row.
    before = await hits(client)
    streamed = await streamed_usage(client, {"messages": turn, "max_tokens": 3})
    assert streamed["prompt_tokens"] == second["usage"]["prompt_tokens"]
    assert streamed["prompt_tokens_details"]["cached_tokens"] == streamed["prompt_tokens"] - 1
    assert await hits(client) - before == streamed["prompt_tokens"] - 1


async def test_n_choices_count_the_prompts_cached_tokens_once(client):
    prompt = "The lighthouse keeper counted the ships passing in the night: " * 3
    await post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    before = await hits(client)
    body = await post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "n": 2})
    usage = body["usage"]
    # Each choice is a sequence of its own and reuses the row, as OpenAI counts the prompt once.
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert await hits(client) - before == 2 * (usage["prompt_tokens"] - 1)


async def test_the_responses_api_reports_cached_input_tokens(client):
    body = {"input": "Describe a quiet harbour in one sentence.", "max_output_tokens": 4}
    first = await post(client, "/v1/responses", body)
    assert first["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    second = await post(client, "/v1/responses", body)
    usage = second["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == usage["input_tokens"] - 1
