"""One (workload, routing) run of the prefix-routing benchmark: the requests it sent, what each
got back, and the figures it comes to (``summarize``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.lib.chat_workloads import IdealCache, Messages, RequestFailed, chat_ids, stream_chat
from bench.lib.openai_load import percentile
from bench.lib.pool_stack import LoadSampler

WARM: Messages = [{"role": "user", "content": "Hello"}]


@dataclass
class Sent:
    """One request: its messages, whether it was a later turn, and its answer (None: failed)."""

    sequence: int  # the order requests were sent in
    messages: Messages
    later_turn: bool
    label: str = ""  # its conversation (chat workloads)
    turn: int = 0
    sent_at_s: float = 0.0  # since the run's first request
    answer: str | None = None
    ttft_s: float = 0.0
    prompt_tokens: int = 0  # the server's usage figure
    completion_tokens: int = 0
    cached_tokens: int = 0  # the engine's usage: prompt tokens its rows held
    queue_wait_ms: float | None = None
    error: str = ""


@dataclass
class CellRun:
    """The requests of one run, sent round-robin to the gateways through one HTTP session."""

    model: str
    timeout_s: float
    sent: list[Sent] = field(default_factory=list)
    wall_s: float = 0.0
    counters: list[dict[str, float]] = field(default_factory=list)  # per engine, after - before
    sampler: LoadSampler | None = None
    _session: aiohttp.ClientSession | None = None
    _turn: itertools.count[int] = field(default_factory=itertools.count)
    _started: float | None = None

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self._session = session
            try:
                yield
            finally:
                self._session = None

    async def warm(self, engines: list[str]) -> None:
        """One short request straight to each engine (its first steps are slow), before the
        counters are read."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            body: dict[str, Any] = {"model": self.model, "messages": WARM}
            body |= {"max_tokens": 4, "temperature": 0}
            await asyncio.gather(*(stream_chat(session, url, body) for url in engines))

    async def send(
        self,
        gateways: list[str],
        messages: Messages,
        max_tokens: int,
        later_turn: bool,
        headers: dict[str, str] | None,
        args: Any,
        label: str = "",
        turn: int = 0,
    ) -> str | None:
        """Send one streamed chat completion to the next gateway; the answer's text, or None
        when it failed (recorded either way)."""
        assert self._session is not None, "send inside session()"
        sequence = next(self._turn)
        now = time.perf_counter()
        self._started = self._started if self._started is not None else now
        record = Sent(sequence, messages, later_turn, label, turn, now - self._started)
        self.sent.append(record)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        body |= {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": args.ignore_eos}
        url = gateways[sequence % len(gateways)]
        try:
            answer = await stream_chat(self._session, url, body, headers)
        except RequestFailed as error:
            record.error = str(error)
            return None
        except (aiohttp.ClientError, TimeoutError) as error:
            record.error = f"{type(error).__name__}: {error}"
            return None
        record.answer, record.ttft_s = answer.text, answer.ttft_s
        record.prompt_tokens, record.completion_tokens = (
            answer.prompt_tokens,
            answer.completion_tokens,
        )
        record.cached_tokens, record.queue_wait_ms = answer.cached_tokens, answer.queue_wait_ms
        return answer.text


def quantiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return percentile(values, 50), percentile(values, 90)


def summarize(run: CellRun, tokenizer: Any) -> dict[str, Any]:
    """The run's figures: hit share from the engines' counters beside the ideal, TTFTs, rates,
    balance and the most requests an engine ran at once."""
    ideal = IdealCache()
    ideal.add(chat_ids(tokenizer, WARM))  # every engine holds the warm-up's row
    prompt_total = reusable_total = usage_total = 0
    requests: list[dict[str, Any]] = []
    for record in sorted(run.sent, key=lambda r: r.sequence):
        ids = chat_ids(tokenizer, record.messages)
        if record.answer is None:
            continue
        reusable = ideal.reusable(ids)
        prompt_total += len(ids)
        usage_total += record.prompt_tokens
        reusable_total += reusable
        ideal.add(ids + tokenizer.encode(record.answer, add_special_tokens=False))
        requests.append(
            {
                "label": record.label,
                "turn": record.turn,
                "sent_at_s": round(record.sent_at_s, 3),
                "ttft_s": round(record.ttft_s, 3),
                "queue_wait_ms": record.queue_wait_ms,
                "prompt_tokens": record.prompt_tokens,
                "cached_tokens": record.cached_tokens,
                "ideal_reusable_tokens": reusable,
            }
        )
    done = [r for r in run.sent if r.answer is not None]
    errors: dict[str, int] = {}
    for record in run.sent:
        if record.error:
            key = record.error.split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
    queries = sum(c["vllm:prefix_cache_queries"] for c in run.counters)
    hits = sum(c["vllm:prefix_cache_hits"] for c in run.counters)
    per_engine = [c["vllm:request_success"] for c in run.counters]
    mean = sum(per_engine) / len(per_engine) if per_engine else 0.0
    hit_share = hits / queries if queries else None
    ideal_share = reusable_total / prompt_total if prompt_total else None
    first_p50, first_p90 = quantiles([r.ttft_s for r in done if not r.later_turn])
    later_p50, later_p90 = quantiles([r.ttft_s for r in done if r.later_turn])
    all_p50, all_p90 = quantiles([r.ttft_s for r in done])
    sampler = run.sampler
    over = None
    if sampler is not None and sampler.slots:
        over = max(m - s for m, s in zip(sampler.max_running, sampler.slots, strict=True))
    return {
        "sent": len(run.sent),
        "completed": len(done),
        "completed_of_sent": len(done) / len(run.sent) * 100 if run.sent else None,
        "num_errors": sum(errors.values()),
        "errors": errors,
        "error_samples": [r.error for r in run.sent if r.error][:5],
        "wall_s": run.wall_s,
        "requests_per_s": len(done) / run.wall_s if run.wall_s else None,
        "prompt_tokens_sent": prompt_total,
        "prompt_tokens_usage": usage_total,  # the engines' count: equal when tokenized alike
        "ideal_reusable_tokens": reusable_total,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "hit_share": hit_share,
        "ideal_share": ideal_share,
        "hit_of_ideal": hit_share / ideal_share if hit_share is not None and ideal_share else None,
        "ttft_first_p50_s": first_p50,
        "ttft_first_p90_s": first_p90,
        "ttft_later_p50_s": later_p50,
        "ttft_later_p90_s": later_p90,
        "ttft_all_p50_s": all_p50,
        "ttft_all_p90_s": all_p90,
        "requests_per_engine": per_engine,
        "busiest_over_mean": max(per_engine) / mean if mean else None,
        "max_running": sampler.max_running if sampler else [],
        "max_slots_held": sampler.max_held if sampler else [],
        "slots": sampler.slots if sampler else [],
        "max_running_over_slots": over,
        "load_samples": sampler.samples if sampler else 0,
        "load_poll_failures": sampler.failures if sampler else 0,
        "hit_of_ideal_by_turn": hit_of_ideal_by_turn(requests),
        "missed_turns": sum(
            1 for r in requests if r["cached_tokens"] * 2 < r["ideal_reusable_tokens"]
        ),
        "requests": requests,
        "measured_at": time.time(),
    }


def hit_of_ideal_by_turn(requests: list[dict[str, Any]]) -> dict[int, float | None]:
    """Per turn of the conversations, the prompt tokens the engines' rows served (each answer's
    usage) over what an ideal router would have reused."""
    by_turn: dict[int, list[int]] = {}
    for request in requests:
        sums = by_turn.setdefault(request["turn"], [0, 0])
        sums[0] += request["cached_tokens"]
        sums[1] += request["ideal_reusable_tokens"]
    return {
        turn: cached / ideal if ideal else None for turn, (cached, ideal) in sorted(by_turn.items())
    }
