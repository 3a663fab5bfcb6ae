"""``n`` choices of one request: ``n`` sequences added together, read as one stream, ended together.

Each choice is a sequence of its own and takes a slot. They share the prompt's prefill through
the prefix cache: the first choice computes the prompt, the others wait for its row and copy it
(all but the last prompt token) when that saves 256 tokens or more; shorter prompts are computed
side by side in the same step, which costs less than a step of waiting (see docs/engine.md).
With a ``seed``, choice ``i`` samples with ``seed + i`` (vLLM's rule), so the choices differ from
each other and repeat from run to run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from slotserve.engine.core.params import SamplingParams
from slotserve.engine.http.openai_responses import TokenCounts

if TYPE_CHECKING:
    from slotserve.engine.core.async_engine import AsyncEngine, RequestStream
    from slotserve.engine.core.stats import RequestOutput
    from slotserve.engine.http.http_state import ServerState

# OpenAI's own bound on n; the engine's slots bound it further (checked by the caller).
MAX_CHOICES = 128


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    if params.seed is None:
        return [params] * n
    return [params.model_copy(update={"seed": params.seed + i}) for i in range(n)]


class Choices:
    """The streams of one request's choices, merged into ``(index, output)`` pairs."""

    def __init__(self, streams: list[RequestStream], per_prompt: int | None = None) -> None:
        self.streams = streams
        # Choices per prompt: a batch of prompts has its choices prompt by prompt.
        self.per_prompt = per_prompt or len(streams)
        self.finished = [False] * len(streams)
        # Each choice's last output (its metrics place it in the request's trace).
        self.final_outputs: list[RequestOutput | None] = [None] * len(streams)
        # Each choice's text so far (its row's answer, for the prefix keys /load reports).
        self.texts: list[list[str]] = [[] for _ in streams]

    @classmethod
    def add(
        cls,
        engine: AsyncEngine,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        n: int,
    ) -> Choices:
        """Add all ``n`` or none: if one add raises, the ones added are aborted at once."""
        return cls.add_batch(engine, request_id, [(prompt, params)], n)

    @classmethod
    def add_batch(
        cls,
        engine: AsyncEngine,
        request_id: str,
        prompts: list[tuple[str | list[int], SamplingParams]],
        n: int,
    ) -> Choices:
        """``n`` choices for each prompt, prompt by prompt (choice ``i`` of prompt ``p`` is at
        index ``p * n + i``, as OpenAI numbers a batch). All or none are added."""
        one = len(prompts) == 1
        streams: list[RequestStream] = []
        try:
            for p, (prompt, params) in enumerate(prompts):
                base = request_id if one else f"{request_id}-{p}"
                ids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
                for choice_id, choice in zip(ids, choice_params(params, n), strict=True):
                    streams.append(engine.add_request(choice_id, prompt, choice))
        except BaseException:
            for stream in streams:
                engine.abort(stream.request_id)
            raise
        return cls(streams, n)

    def finals(self) -> list[RequestOutput]:
        """Every choice's final output, by index, once all have finished (``record``)."""
        return [output for output in self.final_outputs if output is not None]

    def counts(self, outputs: list[RequestOutput]) -> TokenCounts:
        """The usage of a request whose choices' final outputs are ``outputs`` (by index): each
        prompt counted once, as OpenAI does (and its cached tokens with it)."""
        firsts = outputs[:: self.per_prompt]
        return TokenCounts(
            prompt=sum(output.num_prompt_tokens for output in firsts),
            generated=sum(output.num_generated_tokens for output in outputs),
            cached=sum(output.num_cached_tokens for output in firsts),
        )

    def record(self, state: ServerState, index: int, output: RequestOutput) -> None:
        self.finished[index] = True
        self.final_outputs[index] = output
        state.metrics.observe_finished(output.finish_reason or "abort", output.metrics)

    @property
    def unfinished_ids(self) -> list[str]:
        return [
            s.request_id for s, done in zip(self.streams, self.finished, strict=True) if not done
        ]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs as they come, each tagged with its choice index."""
        if len(self.streams) == 1:
            async for output in self.streams[0]:
                self.texts[0].append(output.text)
                yield 0, output
            return
        merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            async for output in stream:
                merged.put_nowait((index, output))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(self.streams)
            while remaining:
                index, output = await merged.get()
                remaining -= output.finished
                self.texts[index].append(output.text)
                yield index, output
        finally:
            for task in tasks:
                task.cancel()
