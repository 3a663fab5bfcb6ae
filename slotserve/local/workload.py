"""The demo's workloads and the async driver that sends them through the gateway.

Late arrivals are triggered by progress, not by the clock: "send request X once the longest
request has produced N tokens". That keeps the story the same on a fast GPU, on two CPU cores and
with the tiny test model, where a fixed delay in seconds would arrive too early or too late.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import httpx

SEED_MAX_TOKENS = (20, 50, 100, 500)
# Late arrivals: (tokens the longest seed request has produced, max_tokens of the new request).
SEED_LATE_ARRIVALS = tuple((10 + 50 * index, 100) for index in range(8))
BURST_MAX_TOKENS = 16
# A burst request must outlast the burst's own arrival, or the queue never fills (tiny models).
MIN_BURST_MAX_TOKENS = 16
TOPICS = (
    "a lighthouse keeper", "a lost robot", "the first city on Mars", "a tiny dragon",
    "an old map", "a talking cat", "a winter market", "the last train home",
    "a clockmaker", "a deep-sea diver", "a haunted library", "a desert caravan",
)  # fmt: skip


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload; ``after_tokens`` of ``trigger_id`` gate a late arrival."""

    request_id: str
    max_tokens: int
    prompt: str
    group: str
    trigger_id: str | None = None
    after_tokens: int = 0


@dataclass
class RequestResult:
    """What the client saw; times are seconds since the phase started."""

    request_id: str
    group: str
    max_tokens: int
    status: int = 0
    sent_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float = 0.0
    num_tokens: int = 0
    finish_reason: str | None = None
    retry_after: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def ttft(self) -> float | None:
        """Time to first token as the client saw it: gateway queueing included."""
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.first_token_at is None or self.num_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.num_tokens - 1)

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "ttft": self.ttft, "tpot": self.tpot}


def _scaled(value: int, scale: float) -> int:
    return max(1, round(value * scale))


def _prompt(index: int) -> str:
    return f"Tell me a long story about {TOPICS[index % len(TOPICS)]}."


def seed_workload(scale: float = 1.0) -> list[RequestSpec]:
    """The seed's four requests (20, 50, 100, 500 tokens) plus late arrivals, all ignore_eos."""
    specs = [
        RequestSpec(f"seed-{n}", _scaled(n, scale), _prompt(i), "seed")
        for i, n in enumerate(SEED_MAX_TOKENS)
    ]
    longest = specs[-1].request_id
    specs += [
        RequestSpec(
            f"late-{i + 1}",
            _scaled(n, scale),
            _prompt(len(SEED_MAX_TOKENS) + i),
            "late",
            trigger_id=longest,
            after_tokens=_scaled(after, scale),
        )
        for i, (after, n) in enumerate(SEED_LATE_ARRIVALS)
    ]
    return specs


def burst_workload(num_requests: int, scale: float = 1.0) -> list[RequestSpec]:
    """``num_requests`` requests sent at once: more than slots plus queue can hold."""
    max_tokens = max(MIN_BURST_MAX_TOKENS, _scaled(BURST_MAX_TOKENS, scale))
    return [
        RequestSpec(f"burst-{i + 1}", max_tokens, _prompt(i), "burst") for i in range(num_requests)
    ]


class _Progress:
    """Token counts per request, and the late arrivals waiting for them."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.waiters: list[tuple[str, int, asyncio.Event]] = []

    def wait_for(self, request_id: str, num_tokens: int) -> asyncio.Event:
        event = asyncio.Event()
        if self.tokens.get(request_id, 0) >= num_tokens:
            event.set()
        else:
            self.waiters.append((request_id, num_tokens, event))
        return event

    def update(self, request_id: str, num_tokens: int) -> None:
        self.tokens[request_id] = num_tokens
        for waiter in list(self.waiters):
            if waiter[0] == request_id and num_tokens >= waiter[1]:
                waiter[2].set()
                self.waiters.remove(waiter)

    def release(self, request_id: str) -> None:
        """The request ended (maybe early or failed): nobody may wait on it forever."""
        self.update(request_id, 1 << 62)


async def _stream_one(
    client: httpx.AsyncClient,
    gateway_url: str,
    model: str,
    spec: RequestSpec,
    t0: float,
    progress: _Progress,
    on_token: Callable[[str], None] | None,
) -> RequestResult:
    result = RequestResult(spec.request_id, spec.group, spec.max_tokens)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": spec.prompt}],
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result.sent_at = time.monotonic() - t0
    try:
        async with client.stream(
            "POST", f"{gateway_url}/v1/chat/completions", json=body
        ) as response:
            result.status = response.status_code
            result.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = _error_message(text)
                return result
            num_chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.num_tokens = int(chunk["usage"].get("completion_tokens", 0))
                for choice in chunk.get("choices", []):
                    now = time.monotonic() - t0
                    if choice.get("delta", {}).get("content"):
                        num_chunks += 1
                        if result.first_token_at is None:
                            result.first_token_at = now
                        result.finished_at = now
                        progress.update(spec.request_id, num_chunks)
                        if on_token is not None:
                            on_token(spec.request_id)
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
            if result.num_tokens == 0:
                result.num_tokens = num_chunks
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if not result.finished_at:
            result.finished_at = time.monotonic() - t0
        progress.release(spec.request_id)
    return result


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def run_workload(
    gateway_url: str,
    model: str,
    specs: list[RequestSpec],
    *,
    stagger_seconds: float = 0.0,
    timeout_seconds: float = 900.0,
    on_token: Callable[[str], None] | None = None,
    t0: float | None = None,
) -> tuple[list[RequestResult], float]:
    """Send ``specs`` through the gateway (streaming chat); return results and the wall time.

    Requests without a trigger are sent at once (``stagger_seconds`` apart, in order); late
    arrivals are sent when their trigger request has produced ``after_tokens`` tokens. Times in
    the results count from ``t0`` (``time.monotonic()``; default: now).
    """
    progress = _Progress()
    limits = httpx.Limits(max_connections=len(specs) + 4, max_keepalive_connections=len(specs))
    timeout = httpx.Timeout(timeout_seconds, connect=10.0)
    t0 = time.monotonic() if t0 is None else t0

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def send(index: int, spec: RequestSpec) -> RequestResult:
            if spec.trigger_id is not None:
                await progress.wait_for(spec.trigger_id, spec.after_tokens).wait()
            elif stagger_seconds:
                await asyncio.sleep(index * stagger_seconds)
            return await _stream_one(client, gateway_url, model, spec, t0, progress, on_token)

        results = await asyncio.gather(*(send(i, spec) for i, spec in enumerate(specs)))
    wall = max((r.finished_at for r in results), default=0.0) - min(
        (r.sent_at for r in results), default=0.0
    )
    return list(results), wall
