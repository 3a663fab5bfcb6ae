"""Bounded memory (issue 25, item 1): a replica's requests hold at most its memory budget (503 +
Retry-After past it), a body must arrive in time (408), and JSON too large or too deep is a 400
before any tree is built. The default budget is read from the container's cgroup as the engine
sizes its cache."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from slotserve.gateway.http.memory_budget import MemoryBudget, MemorySources, default_budget_bytes
from slotserve.gateway.http.request_limits import check_json_bounds
from tests.gateway.gateway_support import pool
from tests.support import free_port

DEAD = "http://127.0.0.1:9"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"model": "m", "x": [' + b"{}," * 349_000 + b"{}]}", "too many values"),
        (b'{"model": "m", "x": ' + b"[" * 65 + b"]" * 65 + b"}", "nested too deeply"),
        (b'{"model": "m", "x": ' + b"[[]," * 100 + b"[]" + b"]" * 100 + b"}", "nested too deeply"),
    ],
)
def test_json_bounds_refuse_before_parsing(body, needle):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=needle):
        check_json_bounds(body, max_nodes=200_000, max_depth=64)
    assert time.perf_counter() - started < 0.5  # a regex pass or two, never the parse


@pytest.mark.parametrize(
    "payload",
    [
        {"model": "m", "prompt": list(range(150_000))},  # a token-id prompt
        {"model": "m", "prompt": "a, b: [c] {d} " * 50_000},  # brackets inside a string
        {"model": "m", "x": [[[[[[[["deep", "but", "not", "too"]]]]]]]]},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}] * 500},
    ],
)
def test_json_bounds_pass_ordinary_bodies(payload):
    check_json_bounds(json.dumps(payload).encode(), max_nodes=200_000, max_depth=64)


async def test_too_many_json_values_is_400_at_the_gateway(gw, client):
    url = await gw([pool("m", [DEAD])])
    body = b'{"model": "m", "prompt": "x", "junk": [' + b"{}," * 349_000 + b"{}]}"
    async with client.post(f"{url}/v1/completions", data=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["code"] == "invalid_json" and "too many values" in error["message"]


def test_memory_budget_reserves_grows_and_releases():
    budget = MemoryBudget(1000)
    first = budget.reserve(600)
    assert first is not None and budget.reserve(500) is None
    assert first.resize(300) and budget.held_bytes == 300
    second = budget.reserve(700)
    assert second is not None and not second.resize(701) and budget.held_bytes == 1000
    first.release()
    second.release()
    assert budget.held_bytes == 0


def _cgroup_v2(tmp_path: Path, limit: str, current: int, inactive: int) -> MemorySources:
    root = tmp_path / "cgroup"
    (root / "pod").mkdir(parents=True)
    (root / "pod" / "memory.max").write_text(limit)
    (root / "pod" / "memory.current").write_text(str(current))
    (root / "pod" / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\n")
    (tmp_path / "self-cgroup").write_text("0::/pod\n")
    (tmp_path / "meminfo").write_text("MemTotal: 99999999 kB\nMemAvailable: 33554432 kB\n")
    return MemorySources(root, tmp_path / "self-cgroup", tmp_path / "meminfo")


def test_default_budget_is_a_share_of_what_the_cgroup_allows(tmp_path):
    # The chart's 512Mi limit, 100 MiB in use of which 20 MiB inactive file pages: 432 MiB left.
    mib = 1 << 20
    sources = _cgroup_v2(tmp_path, str(512 * mib), 100 * mib, 20 * mib)
    assert default_budget_bytes(0.5, sources) == 216 * mib
    # No limit ("max"): the node's MemAvailable (32 GiB here).
    (tmp_path / "cgroup" / "pod" / "memory.max").write_text("max\n")
    assert default_budget_bytes(0.5, sources) == 16 * 1024 * mib


async def _held(url: str, size: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A completion request of ``size`` bytes for a pool at zero: held in the queue."""
    body = json.dumps({"model": "m", "prompt": "x" * (size - 40), "max_tokens": 1}).encode()
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    return reader, writer


async def test_past_the_budget_503_with_retry_after_and_back_when_bytes_free(gw, client):
    """Budget 3 MiB: three held requests of 900 KB fit, the fourth is 503 with Retry-After (the
    replica keeps serving everything else: /health, /metrics), and once a held client goes away
    its bytes are free again."""
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens: requests are held at zero
    url = await gw(
        [pool("m", [endpoint], queueTimeoutSeconds=30)], memory_budget_bytes=3 * 1024 * 1024
    )
    held = [await _held(url, 900_000) for _ in range(3)]
    await asyncio.sleep(0.5)
    body = {"model": "m", "prompt": "x" * 900_000, "max_tokens": 1}
    async with client.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "memory_budget_exceeded"
    async with client.get(f"{url}/metrics") as resp:
        text = await resp.text()
    assert "slotserve_gateway_memory_budget_bytes 3.145728e+06" in text
    held_line = next(x for x in text.splitlines() if x.startswith("slotserve_gateway_held_bytes"))
    assert float(held_line.split()[1]) > 2_700_000
    _, writer = held.pop()
    writer.close()  # a held client goes away: its bytes are free again
    deadline = time.monotonic() + 5
    while True:
        probe = asyncio.create_task(_held(url, 900_000))
        reader, probe_writer = await probe
        try:
            line = await asyncio.wait_for(reader.readline(), 0.5)
        except TimeoutError:
            line = b""  # no answer: held in the queue, so it fitted
        probe_writer.close()
        if not line:
            break
        assert b"503" in line and time.monotonic() < deadline
        await asyncio.sleep(0.1)
    for _, writer in held:
        writer.close()


async def test_a_body_that_does_not_arrive_is_408(gw):
    url = await gw([pool("m", [DEAD])], body_read_timeout_seconds=0.5)
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model": '
    )
    await writer.drain()
    started = time.monotonic()
    status = await asyncio.wait_for(reader.readline(), 5)
    assert b" 408 " in status and time.monotonic() - started < 3
    rest = await asyncio.wait_for(reader.read(4096), 5)
    assert b'"code": "body_timeout"' in rest
    assert b'"type": "invalid_request_error"' in rest
    writer.close()
