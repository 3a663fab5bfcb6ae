"""Load on an OpenAI-compatible server as a user's clients make it: C clients, each sending its
share of the requests one after another, streamed ``/v1/completions``; per request the time to
first token and the gaps between tokens, per run the aggregate rates and their percentiles
(reported as ``vllm bench serve`` reports them).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class RequestTiming:
    """One streamed request as the client saw it."""

    prompt_tokens: int  # the server's usage figure
    completion_tokens: int
    ttft_s: float  # request sent to first token chunk
    latency_s: float  # request sent to the stream's end
    # Gaps between successive chunks (a chunk is one token on both servers measured; a chunk
    # of k tokens would count as one gap).
    itl_s: list[float] = field(default_factory=list)


@dataclass
class LoadResult:
    """C clients' requests, all of them finished."""

    concurrency: int
    wall_s: float
    requests: list[RequestTiming]

    @property
    def output_tokens_per_s(self) -> float:
        return sum(r.completion_tokens for r in self.requests) / self.wall_s

    @property
    def prompt_tokens_per_s(self) -> float:
        return sum(r.prompt_tokens for r in self.requests) / self.wall_s

    def summary(self) -> dict[str, Any]:
        """The figures a report prints, plus what they were taken over."""
        ttfts = [r.ttft_s for r in self.requests]
        gaps = [gap for r in self.requests for gap in r.itl_s]
        tpots = [
            (r.latency_s - r.ttft_s) / (r.completion_tokens - 1)
            for r in self.requests
            if r.completion_tokens > 1
        ]
        return {
            "concurrency": self.concurrency,
            "num_requests": len(self.requests),
            "wall_s": self.wall_s,
            "prompt_tokens": sum(r.prompt_tokens for r in self.requests),
            "completion_tokens": sum(r.completion_tokens for r in self.requests),
            # Equal to max_tokens when every request made all its tokens (EOS ignored).
            "min_completion_tokens": min(r.completion_tokens for r in self.requests),
            "output_tokens_per_s": self.output_tokens_per_s,
            "prompt_tokens_per_s": self.prompt_tokens_per_s,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(gaps, 50) if gaps else None,
            "tpot_p50_s": percentile(tpots, 50) if tpots else None,
        }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linearly interpolated (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy streamed completion that makes all ``max_tokens`` (EOS ignored), with usage."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # not OpenAI's; vLLM and slotserve both take it
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> RequestTiming:
    """Send one streamed completion to ``url`` and time its chunks."""
    started = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, int] = {}
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            # A chunk a token; after ignore_eos passes EOS, a token may decode to "" (vLLM).
            if event.get("choices"):
                arrivals.append(time.perf_counter())
    ended = time.perf_counter()
    if not arrivals or not usage:
        raise RuntimeError(f"{url} streamed no token or no usage for a request")
    return RequestTiming(
        prompt_tokens=int(usage["prompt_tokens"]),
        completion_tokens=int(usage["completion_tokens"]),
        ttft_s=arrivals[0] - started,
        latency_s=ended - started,
        itl_s=[later - earlier for earlier, later in itertools.pairwise(arrivals)],
    )


async def run_load(url: str, bodies: list[dict[str, Any]], concurrency: int) -> LoadResult:
    """``concurrency`` clients share ``bodies`` in order, each sending one request after another
    (C clients with R requests each: C * R bodies)."""
    queue = list(reversed(bodies))
    timings: list[RequestTiming] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            while queue:
                timings.append(await stream_completion(session, url, queue.pop()))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return LoadResult(concurrency, wall, timings)
