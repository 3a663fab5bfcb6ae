"""Prompts -> token ids without ever making the step loop, or the event loop, wait for a client.

Three things keep one large prompt from stalling everyone else:

- A cheap bound first. No token stands for more characters than the longest entry of the
  vocabulary (byte-level BPE and SentencePiece spell every input character with at least one
  character of a piece), so a text longer than ``max_model_len`` x that many characters can
  never fit and is refused before any tokenizing (SmolLM2: 81 characters, so 165,888 characters
  at the default max_model_len of 2,048; a 1 MB prompt is refused in microseconds).
- Its own thread, at the lowest CPU priority. Tokenizing runs on one worker thread, never on
  the event loop; the Rust tokenizer releases the GIL while it encodes, so ``/load``,
  ``/health`` and the streams go on. The thread runs at nice 19 (Linux): where it competes for a
  core with the step loop, the step loop wins (measured on 2 busy cores: a 650,000-character
  encode beside two SmolLM2 streams tripled their step time at the same priority, and left it
  unchanged at nice 19). Clients, not the engine, pay for their prompts: tokenizing waits for
  spare CPU.
- Little GIL-holding work. The encode is capped at ``max_model_len + 1`` tokens (truncation),
  so a prompt that is too long never becomes a list of a hundred thousand Python ints, and a
  conversation may have at most ``max_model_len`` messages (chat templates mark each message
  with at least one token), so rendering one stays short: rendering is pure Python, and 35,000
  empty messages (a 1 MB body) took 270 ms of GIL.
- Its own tokenizer. The step loop's thread detokenizes with the engine's tokenizer under a lock
  (the Rust tokenizer refuses overlapping calls when one mutates it); the worker uses a copy of
  its own and never takes that lock, so a long encode never delays a step.

Chat templates are rendered on the same worker, for the same reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from slotserve.engine.errors import InvalidRequestError

T = TypeVar("T")

# The tokenizer thread's niceness (19 = lowest priority); see the module docstring.
TOKENIZER_NICENESS = 19


class PromptTooLongError(InvalidRequestError):
    """The prompt cannot fit in the model's context, whatever it tokenizes to (400)."""


class ChatTemplateError(InvalidRequestError):
    """The model's chat template refused the conversation (400)."""


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of input text one token can stand for (see the module docstring)."""
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1)


class PromptTokenizer:
    """Encodes prompts and renders chat templates off the event loop; see the module docstring."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)
        # Copied before any thread uses either: nothing else touches this copy.
        self._tokenizer = copy.deepcopy(tokenizer)
        # One worker: the CPU is shared with the step loop, and requests queue in arrival order.
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="slotserve-tokenize", initializer=_lower_priority
        )

    def check_num_chars(self, num_chars: int, param: str) -> None:
        """Refuse a text that cannot fit (microseconds: only its length is read)."""
        if num_chars > self.max_prompt_chars:
            raise PromptTooLongError(
                f"the prompt has {num_chars} characters; no prompt longer than "
                f"{self.max_prompt_chars} characters fits in this model's maximum context length "
                f"of {self.max_model_len} tokens",
                param=param,
            )

    def check_num_tokens(self, num_tokens: int, param: str) -> None:
        if num_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has more than {self.max_model_len} tokens, this model's maximum "
                "context length",
                param=param,
            )

    async def encode(self, text: str, *, param: str = "prompt") -> list[int]:
        """A completion prompt's ids, with the tokenizer's special tokens (BOS and the like)."""
        self.check_num_chars(len(text), param)
        return await self._run(self._encode, text, True, param)

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of a conversation rendered by the model's chat template, ready to answer."""
        if len(messages) > self.max_model_len:
            raise PromptTooLongError(
                f"the conversation has {len(messages)} messages; no more than "
                f"{self.max_model_len} fit in this model's maximum context length",
                param="messages",
            )
        # The template adds to the messages' text, never takes from it: a cheap first bound.
        self.check_num_chars(sum(len(m["content"]) for m in messages), "messages")
        return await self._run(self._encode_chat, messages)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        # A caller that goes away (client disconnect) leaves a running encode to finish: it is
        # bounded by max_prompt_chars, and the result is dropped.
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- on the worker thread ---------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        # One token more than fits is enough to refuse; the tokenizer still reads the whole
        # text, but without the GIL.
        token_ids = self._tokenizer.encode(
            text,
            add_special_tokens=add_special_tokens,
            truncation=True,
            max_length=self.max_model_len + 1,
        )
        self.check_num_tokens(len(token_ids), param)
        return list(token_ids)

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as error:  # jinja raises for conversations the template refuses
            raise ChatTemplateError(f"chat template error: {error}", param="messages") from error
        self.check_num_chars(len(text), "messages")
        # The template already holds the special tokens; never add a second BOS.
        return self._encode(text, False, "messages")


def _lower_priority() -> None:
    """Make the calling thread the last to get a core (Linux: niceness is per thread)."""
    if sys.platform == "linux":
        # A failure leaves the thread at normal priority; raising from an initializer would
        # break the pool and with it every request.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICENESS)
