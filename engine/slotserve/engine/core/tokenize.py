"""Prompts -> token ids without ever making the step loop, or the event loop, wait for a client.

Four things keep one large prompt from stalling everyone else:

- A cheap bound first. No token stands for more characters than the longest entry of the
  vocabulary (byte-level BPE and SentencePiece spell every input character with at least one
  character of a piece), so a text longer than ``max_model_len`` x that many characters can
  never fit and is refused before any tokenizing (SmolLM2: 81 characters, so 165,888 characters
  at the default max_model_len of 2,048; a 1 MB prompt is refused in microseconds). A
  conversation may have at most ``max_model_len`` messages (chat templates mark each message
  with at least one token).
- A process of its own. Prompts are encoded, and chat templates rendered, in one worker process
  with its own copy of the tokenizer: never on the event loop, never under the lock the step
  loop's detokenizer takes, and never holding this process's GIL. (A worker thread was tried
  first: the Rust encode releases the GIL, but the Python around it does not, and a
  low-priority thread preempted while holding the GIL stalled ``/load`` for 455 ms and the
  streams for up to 3.6x their inter-token time on 2 busy cores.)
- The lowest CPU priority. The worker process runs at nice 19, so where it competes for a core
  with the step loop, the step loop wins: clients, not the engine, pay for their prompts, and a
  long one waits for spare CPU.
- Bounded results. The encode stops at ``max_model_len + 1`` tokens (truncation): a prompt that
  is too long never becomes a hundred thousand ints to send back.

The worker starts with the engine (``start``: ~3 s of imports, ~330 MB), and the engine takes
work only once it answers (bounded by ``WORKER_START_SECONDS``); it loads at normal priority and
drops to nice 19 once ready: at nice 19 on busy cores those seconds of imports stretched past a
minute, and the first prompts waited out ``TOKENIZE_WAIT_SECONDS``. It exits within half a
second of the engine, however the engine ends; one that dies (say, killed for memory) fails the
requests it held with :class:`TokenizerUnavailableError`, and the next prompt starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from slotserve.engine.core.errors import EngineError, InvalidRequestError
from slotserve.engine.core.protocols import Tokenizer

T = TypeVar("T")
logger = logging.getLogger(__name__)

# The worker process's niceness (19 = lowest priority); see the module docstring.
TOKENIZER_NICENESS = 19
# How often the worker checks that its engine is still there.
ENGINE_WATCH_SECONDS = 0.5
# Longest a request waits for the worker (its own prompt plus those queued ahead of it): a prompt
# within the characters bound takes well under a second, so this only trips when a flood of huge
# prompts queues everyone behind it; the request then gets 503 (retryable elsewhere).
TOKENIZE_WAIT_SECONDS = 30.0
# Longest the engine waits at start for the worker to answer before it takes work anyway (the
# first prompts then wait for it, within TOKENIZE_WAIT_SECONDS).
WORKER_START_SECONDS = 120.0


class _FromWorker(InvalidRequestError):
    """Raised in the worker process: pickled back whole (message and param)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.param))


class PromptTooLongError(_FromWorker):
    """The prompt cannot fit in the model's context, whatever it tokenizes to (400)."""


class ChatTemplateError(_FromWorker):
    """The model's chat template refused the conversation (400)."""


class TokenizerUnavailableError(EngineError):
    """The worker process died, or was busy too long, while it held this prompt (503: retry)."""


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of input text one token can stand for (see the module docstring)."""
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1)


class PromptTokenizer:
    """Encodes prompts and renders chat templates in a worker process; see the module docstring."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        on_settled: Callable[[], None] | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)
        self._tokenizer_state = pickle.dumps(tokenizer)  # what each worker process starts from
        self._executor: ProcessPoolExecutor | None = None
        # Prompts being tokenized now (read by the engine's loop thread), and what to call
        # each time one is done, whatever its outcome.
        self.in_flight = 0
        self._on_settled = on_settled

    async def start(self) -> None:
        """Start the worker now rather than at the first prompt, and wait (bounded) until it
        answers."""
        started = asyncio.wrap_future(self._pool().submit(_ping))
        try:
            await asyncio.wait_for(started, WORKER_START_SECONDS)
        except TimeoutError:
            logger.warning(
                "the tokenizer worker did not answer within %g s of starting; taking work anyway",
                WORKER_START_SECONDS,
            )
        except BrokenProcessPool:
            self._executor = None  # the first prompt starts a new one
            logger.warning("the tokenizer worker died while starting; the first prompt retries")

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def check_num_chars(self, num_chars: int, param: str) -> None:
        """Refuse a text that cannot fit (microseconds: only its length is read)."""
        _check_num_chars(num_chars, self.max_prompt_chars, self.max_model_len, param, "the prompt")

    def check_num_tokens(self, num_tokens: int, param: str) -> None:
        _check_num_tokens(num_tokens, self.max_model_len, param)

    async def encode(
        self,
        text: str,
        *,
        param: str = "prompt",
        add_special_tokens: bool = True,
        for_engine: bool = True,
    ) -> list[int]:
        """A completion prompt's ids, with the tokenizer's special tokens (BOS and the like)
        unless ``add_special_tokens`` is False. ``for_engine``: the ids go on to the engine
        (counted in :attr:`in_flight` meanwhile; ``/tokenize`` passes False)."""
        self.check_num_chars(len(text), param)
        return await self._run(_encode, text, add_special_tokens, param, counted=for_engine)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        for_engine: bool = True,
    ) -> list[int]:
        """The ids of a conversation (and its tools) rendered by the model's chat template,
        ready to answer (``for_engine``: as :meth:`encode`'s)."""
        if len(messages) > self.max_model_len:
            raise PromptTooLongError(
                f"the conversation has {len(messages)} messages; no more than "
                f"{self.max_model_len} fit in this model's maximum context length",
                param="messages",
            )
        # The template adds to the messages' text, never takes from it: a cheap first bound.
        self.check_num_chars(sum(len(m.get("content") or "") for m in messages), "messages")
        return await self._run(
            _encode_chat,
            messages,
            self.max_prompt_chars,
            tools,
            add_generation_prompt,
            counted=for_engine,
        )

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=1,
                # Not fork: this process runs threads (the step loop, torch's), and a forked
                # child would start with their locks held.
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self._tokenizer_state, self.max_model_len),
            )
        return self._executor

    async def _run(self, fn: Callable[..., T], *args: Any, counted: bool = True) -> T:
        # A caller that goes away (client disconnect) leaves a running encode to finish: it is
        # bounded by max_prompt_chars, and the result is dropped.
        executor = self._pool()
        self.in_flight += counted
        try:
            return await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(executor, fn, *args),
                TOKENIZE_WAIT_SECONDS,
            )
        except TimeoutError as error:
            raise TokenizerUnavailableError(
                f"tokenizing waited over {TOKENIZE_WAIT_SECONDS:g} s behind other prompts; retry"
            ) from error
        except BrokenProcessPool as error:
            if self._executor is executor:
                self._executor = None  # the next prompt starts a new worker
            raise TokenizerUnavailableError("the tokenizer process died; retry") from error
        finally:
            self.in_flight -= counted
            if counted and self._on_settled is not None:
                self._on_settled()


def _check_num_chars(
    num_chars: int, max_prompt_chars: int, max_model_len: int, param: str, what: str
) -> None:
    if num_chars > max_prompt_chars:
        raise PromptTooLongError(
            f"{what} has {num_chars} characters; no prompt longer than {max_prompt_chars} "
            f"characters fits in this model's maximum context length of {max_model_len} tokens",
            param=param,
        )


def _check_num_tokens(num_tokens: int, max_model_len: int, param: str) -> None:
    if num_tokens > max_model_len:
        raise PromptTooLongError(
            f"the prompt has more than {max_model_len} tokens, this model's maximum context length",
            param=param,
        )


# -- in the worker process ----------------------------------------------------------------------


class _Worker:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len


# The worker process's one tokenizer, set by its initializer (the usual process-pool pattern:
# functions sent to the pool find their state here).
_worker: _Worker | None = None


def _start_worker(tokenizer_state: bytes, max_model_len: int) -> None:
    global _worker
    # The worker holds both ends of its task queue, so it never sees the engine go: an engine
    # that exits with os._exit or is killed would leave it waiting forever. It watches instead.
    engine_pid = os.getppid()
    threading.Thread(
        target=_exit_with_engine, args=(engine_pid,), name="engine-watch", daemon=True
    ).start()
    # One prompt at a time, on this process's one thread: no pool of helper threads.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = _Worker(pickle.loads(tokenizer_state), max_model_len)
    # Lowest priority only from here on: loading at nice 19 on busy cores took over a minute.
    with contextlib.suppress(OSError):  # at worst the worker keeps normal priority
        os.nice(TOKENIZER_NICENESS)


def _exit_with_engine(engine_pid: int) -> None:
    while os.getppid() == engine_pid:  # an orphan is adopted by another process
        time.sleep(ENGINE_WATCH_SECONDS)
    os._exit(0)


def _ping() -> None:
    """Nothing: submitting it starts the worker."""


def _encode(text: str, add_special_tokens: bool, param: str) -> list[int]:
    assert _worker is not None, "the pool initializer sets the worker"
    # One token more than fits is enough to refuse; the tokenizer still reads the whole text.
    token_ids = _worker.tokenizer.encode(
        text,
        add_special_tokens=add_special_tokens,
        truncation=True,
        max_length=_worker.max_model_len + 1,
    )
    _check_num_tokens(len(token_ids), _worker.max_model_len, param)
    return list(token_ids)


def _encode_chat(
    messages: list[dict[str, Any]],
    max_prompt_chars: int,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    assert _worker is not None, "the pool initializer sets the worker"
    try:
        text = _worker.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as error:  # jinja raises for conversations the template refuses
        raise ChatTemplateError(f"chat template error: {error}", param="messages") from None
    _check_num_chars(
        len(text), max_prompt_chars, _worker.max_model_len, "messages", "the rendered conversation"
    )
    # The template already holds the special tokens; never add a second BOS.
    return _encode(text, False, "messages")
