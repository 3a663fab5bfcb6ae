"""Chat workloads whose prompts share prefixes, as users make them, and what they could reuse.

- Conversations: each turn a distinct user message (a window of shipped text, exactly
  ``message_tokens`` tokens) on top of the history (earlier messages and the assistant's actual
  answers), a think time between turns.
- Shared system prompts: a few long system prompts, each request one of them and a short
  distinct question.

``IdealCache`` says how many of a prompt's tokens an engine could serve from cache at best: the
longest prefix it shares with any earlier prompt plus that prompt's answer, as one engine with
room for every row would hold them. The prompts are tokenized as the engine does
(``engine/core/tokenize.py``: the chat template rendered to text, then encoded without added
special tokens).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from slotserve.contracts.headers import QUEUE_WAIT_MS_HEADER
from slotserve.engine.core.prefix_cache import MIN_REUSE_TOKENS

TEXT = Path(__file__).resolve().parents[1] / "data" / "quality_text.txt"
Messages = list[dict[str, str]]


class TextWindows:
    """Distinct windows of the shipped text, ``num_tokens`` tokens each, at seeded offsets no
    two of which are equal (so no two windows start alike)."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
        self.rng = random.Random(seed)
        self.used: set[int] = set()

    def take(self, num_tokens: int) -> str:
        free = [o for o in range(len(self.ids) - num_tokens) if o not in self.used]
        if not free:
            raise ValueError(f"the text holds no more distinct {num_tokens}-token windows")
        offset = self.rng.choice(free)
        self.used.add(offset)
        return str(self.tokenizer.decode(self.ids[offset : offset + num_tokens]))


@dataclass(frozen=True)
class Conversation:
    """One user's chat: a user message per turn, and the seconds they think before each later
    turn (``think_s[i]`` before turn ``i + 1``)."""

    id: str
    messages: tuple[str, ...]
    think_s: tuple[float, ...]


def conversations(
    tokenizer: Any,
    count: int,
    turns: int,
    message_tokens: int,
    think_s: tuple[float, float],
    seed: int,
) -> list[Conversation]:
    """``count`` conversations of ``turns`` distinct messages each, seeded."""
    windows = TextWindows(tokenizer, seed)
    rng = random.Random(seed + 1)
    out = []
    for c in range(count):
        texts = tuple(
            f"{windows.take(message_tokens)}\n\nWhat is this passage about?" for _ in range(turns)
        )
        waits = tuple(rng.uniform(*think_s) for _ in range(turns - 1))
        out.append(Conversation(f"conv-{seed}-{c}", texts, waits))
    return out


def system_requests(
    tokenizer: Any, num_prompts: int, prompt_tokens: int, num_requests: int, seed: int
) -> list[Messages]:
    """``num_requests`` requests, each one of ``num_prompts`` system prompts of about
    ``prompt_tokens`` tokens and a distinct question; as many of each prompt (to one), shuffled."""
    windows = TextWindows(tokenizer, seed)
    prompts = [
        f"You are assistant {k}. Answer only from this reference text.\n\n"
        f"{windows.take(prompt_tokens)}"
        for k in range(num_prompts)
    ]
    words = sorted({w.strip(".,;:()\"'").lower() for w in TEXT.read_text().split() if len(w) > 6})
    rng = random.Random(seed + 1)
    requests = []
    for i in range(num_requests):
        question = f"Question {i}: what does the text say about '{rng.choice(words)}'?"
        requests.append(
            [
                {"role": "system", "content": prompts[i % num_prompts]},
                {"role": "user", "content": question},
            ]
        )
    rng.shuffle(requests)
    return requests


def chat_ids(tokenizer: Any, messages: Messages) -> list[int]:
    """The prompt's tokens as the engine makes them."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class IdealCache:
    """Token sequences served so far (prompt + answer); ``reusable`` is the longest prefix a new
    prompt shares with one of them (below the engine's MIN_REUSE_TOKENS: none, as the engine
    does)."""

    rows: list[list[int]] = field(default_factory=list)

    def reusable(self, ids: list[int]) -> int:
        best = 0
        for row in self.rows:
            limit = min(len(row), len(ids))
            n = 0
            while n < limit and row[n] == ids[n]:
                n += 1
            best = max(best, n)
        # A prompt's last token is always computed (its logits make the first new token).
        best = min(best, len(ids) - 1)
        return best if best >= MIN_REUSE_TOKENS else 0

    def add(self, ids: list[int]) -> None:
        self.rows.append(ids)


@dataclass
class ChatAnswer:
    """One streamed chat completion as the client saw it."""

    text: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # usage.prompt_tokens_details: what the engine's rows held
    queue_wait_ms: float | None = None  # the gateway's x-slotserve-queue-wait-ms


class RequestFailed(Exception):
    """A request answered an error status or a broken stream."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail[:300]}")
        self.status = status


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> ChatAnswer:
    """Send one streamed chat completion (``body`` gets ``stream`` and usage) to ``url`` and
    time its first content chunk; the answer's text is the chunks' content joined."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RequestFailed(resp.status, await resp.text())
        queue_wait = resp.headers.get(QUEUE_WAIT_MS_HEADER)
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RequestFailed(500, json.dumps(event["error"]))
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    parts.append(content)
    ended = time.perf_counter()
    if not usage:
        raise RequestFailed(0, "the stream ended without usage")
    return ChatAnswer(
        text="".join(parts),
        ttft_s=(first or ended) - started,
        latency_s=ended - started,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
        queue_wait_ms=float(queue_wait) if queue_wait is not None else None,
    )
