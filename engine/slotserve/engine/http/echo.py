"""``echo`` on ``/v1/completions``: the prompt as written back before each choice's text.

A text prompt is echoed as sent; a token-id prompt as its decoded text. With ``logprobs`` each
prompt token also gets its ``text_offset``, its start in that text: the sum of the earlier
tokens' lengths when the tokens' texts lay end to end make the text (byte-level BPE on whole
characters: the usual case), else the length of the decoded text before the token (a character
split over several tokens, SentencePiece's word-joining spaces), so the offsets always point into
the text the client receives.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from slotserve.engine.http.openai_api import CompletionRequest
from slotserve.engine.http.openai_format import EchoedPrompt, cumulative_offsets

if TYPE_CHECKING:
    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.core.protocols import Tokenizer

# Past this many tokens a prompt whose token texts do not lay out to its text gets cumulative
# offsets: the exact ones decode every prefix (quadratic).
MAX_EXACT_OFFSET_TOKENS = 2048


async def echoed_prompts(
    engine: AsyncEngine, body: CompletionRequest, prompts: list[list[int]]
) -> list[EchoedPrompt]:
    """Each prompt's echo, decoded off the event loop (under the engine's tokenizer lock)."""
    core = engine.engine

    def work() -> list[EchoedPrompt]:
        with core.tokenizer_lock:
            return [
                echo_prompt(core.tokenizer, raw, ids, with_offsets=body.logprobs is not None)
                for raw, ids in zip(body.prompts, prompts, strict=True)
            ]

    return await asyncio.to_thread(work)


def echo_prompt(
    tokenizer: Tokenizer, raw: str | list[int], ids: list[int], *, with_offsets: bool
) -> EchoedPrompt:
    decoded = tokenizer.decode(ids)
    text = raw if isinstance(raw, str) else decoded
    if not with_offsets:
        return EchoedPrompt(text)
    pieces = [tokenizer.decode([token_id]) for token_id in ids]
    if "".join(pieces) == text or len(ids) > MAX_EXACT_OFFSET_TOKENS:
        return EchoedPrompt(text, cumulative_offsets(pieces))
    offsets = [len(tokenizer.decode(ids[:i])) if i else 0 for i in range(len(ids))]
    return EchoedPrompt(text, offsets)
