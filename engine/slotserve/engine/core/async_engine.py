"""The engine for asyncio callers: the step loop runs in a thread, outputs come back as streams.

Handoff: ``add_request``/``abort`` (event-loop thread) put commands into a thread-safe inbox and
wake the loop thread; the loop thread applies them between steps, runs a step, and hands that
step's outputs to the event loop with one ``loop.call_soon_threadsafe`` call, where they are
pushed into each request's ``asyncio.Queue``. The event loop never waits on the model.

Faults: a sequence's own failure ends that sequence (``LLMEngine.step`` handles it). A step that
raises means the runner is broken (a device error, a forward that throws): every request ends
with an ``engine_failure`` error, the loop stops, ``failure`` says why, and the server's probes
fail so that the pod is restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.errors import EngineNotRunningError, InvalidRequestError
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.protocols import Tokenizer
from slotserve.engine.core.sequence import Sequence, SequenceError
from slotserve.engine.core.stats import EngineStats, RequestOutput
from slotserve.engine.core.tokenize import PromptTokenizer
from slotserve.engine.settings import EngineSettings

logger = logging.getLogger(__name__)

ENGINE_FAILURE = SequenceError(
    "engine_failure", "the engine failed while serving this request; retry on another replica"
)

# Longest the loop thread sleeps while idle before re-checking its stop flag.
IDLE_WAIT_SECONDS = 0.5

# Longest an idle engine holds its first step for prompts still being tokenized, so that a burst
# sent together is prefilled together. Without it, 8 ~170-token prompts sent at once to an idle
# engine (a 2-core Zen 5) went 2 in a first step and 6 in a second: the 6 waited for the first
# step and their first tokens came ~0.1 s later than one step of all of them gives (TTFT p50
# 0.43-0.50 s). A lone prompt never waits (nothing else is in flight), nor does a running batch.
GATHER_SECONDS = 0.02


class RequestStream:
    """Async iterator of one request's :class:`RequestOutput` deltas; ends after the final one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._done = False
        self.finished = False  # the final output has been queued

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        output = await self._queue.get()
        if output.finished:
            self._done = True
        return output

    def put(self, output: RequestOutput) -> None:
        """Queue an output (event-loop thread only)."""
        if self.finished:
            return
        self.finished = output.finished
        self._queue.put_nowait(output)


class AsyncEngine:
    """Serves many concurrent requests from asyncio code; see the module docstring."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.settings: EngineSettings = engine.settings
        self.tokenizer: Tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.num_slots: int = engine.kv_cache.num_slots
        self.limits = engine.limits
        # Commands for the loop thread: a validated sequence to add, or a request id to abort.
        self._inbox: queue.SimpleQueue[Sequence | str] = queue.SimpleQueue()
        self._wake = threading.Event()
        # Prompts are tokenized in a process of their own (see tokenize.py); each one done wakes
        # a loop that gathers a burst.
        self.prompts = PromptTokenizer(
            engine.tokenizer, engine.max_model_len, on_settled=self._wake.set
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._num_pending_adds = 0
        self._stats: EngineStats = engine.stats()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._num_step_failures = 0
        self.failure: str | None = None  # set once a step raised: the engine serves no more

    @classmethod
    def load(cls, settings: EngineSettings) -> AsyncEngine:
        """Load model and tokenizer (blocking: call it in a thread from async code)."""
        return cls(LLMEngine.load(settings))

    @property
    def is_running(self) -> bool:
        return self._accepting

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="slotserve-engine", daemon=True)
        self._thread.start()
        await self.prompts.start()
        self._accepting = True

    async def shutdown(self) -> None:
        """Stop the loop; streams still open end with finish_reason "abort"."""
        self._accepting = False
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            self._wake.set()
            await asyncio.to_thread(thread.join)
        self.prompts.close()
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(_abort_output(stream.request_id))

    # -- requests (event-loop thread) -------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> RequestStream:
        """Validate and enqueue; raises at once instead of failing later in the loop."""
        if not self._accepting:
            raise EngineNotRunningError("the engine is not running")
        seq: Sequence = self.engine.make_sequence(request_id, prompt, params)
        with self._lock:
            # Checked again under the lock: a loop thread that has just broken ends every
            # stream registered before it cleared the flag, and none after.
            if not self._accepting:
                raise EngineNotRunningError("the engine is not running")
            if request_id in self._streams:
                raise InvalidRequestError(
                    f"request id {request_id!r} is in use", param="request_id"
                )
            self.limits.check_queue_room(self._expected_waiting())
            stream = RequestStream(request_id)
            self._streams[request_id] = stream
            self._num_pending_adds += 1
            self._inbox.put(seq)
        self._wake.set()
        return stream

    def _expected_waiting(self) -> int:
        """Waiting requests once the inbox is applied: under continuous batching, requests not
        yet handed over take the free slots first."""
        stats = self._stats
        pending = self._num_pending_adds
        if self.settings.policy == "continuous":
            pending = max(0, pending - stats.num_slots_free)
        return stats.num_waiting + pending

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent); its slot is free at the next step."""
        self._inbox.put(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        """The snapshot taken after the loop's last iteration, plus requests not yet handed over."""
        stats = self._stats
        if self._num_step_failures:
            stats = dataclasses.replace(stats, num_step_failures=self._num_step_failures)
        if not self._num_pending_adds:
            return stats
        return dataclasses.replace(stats, num_waiting=self._expected_waiting())

    # -- the loop (engine thread) -----------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_inbox()
            delay = engine.next_step_delay()
            if delay > 0:
                self._stats = engine.stats()
                self._wake.wait(min(delay, IDLE_WAIT_SECONDS))
                continue
            self._gather()
            try:
                outputs = engine.step()
            except Exception as error:
                self._break(error)
                return
            self._stats = engine.stats()
            if outputs:
                self._deliver(outputs)

    def _gather(self) -> None:
        """Hold an idle engine's first step, up to GATHER_SECONDS, while prompts are still being
        tokenized and the step has room for them (:meth:`LLMEngine.may_gather`)."""
        deadline = time.monotonic() + GATHER_SECONDS
        while self.prompts.in_flight and self.engine.may_gather() and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(left)
            self._wake.clear()
            self._drain_inbox()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, str):
                self.engine.abort(command)
                continue
            with self._lock:
                self._num_pending_adds -= 1
            try:
                self.engine.enqueue(command)
            except Exception as error:  # this request only (a duplicate id, its stop strings)
                failure = SequenceError(
                    "internal", f"the request could not start: {type(error).__name__}"
                )
                logger.warning(
                    "request %s could not start: %s", command.request_id, failure.message
                )
                self._deliver([_error_output(command.request_id, failure)])

    def _break(self, error: Exception) -> None:
        """The step raised: the runner is broken. End every request and stop for good."""
        self._num_step_failures += 1
        self.failure = f"engine step failed: {type(error).__name__}"
        with self._lock:
            self._accepting = False
            request_ids = list(self._streams)  # includes adds still in the inbox
            # Nothing will apply the inbox again; its adds end below with the rest.
            while not self._inbox.empty():
                self._inbox.get_nowait()
            self._num_pending_adds = 0
        # Each request's id is logged as it ends (LLMEngine logs every failed sequence).
        logger.error("engine step failed; ending all %d requests", len(request_ids), exc_info=error)
        try:
            outputs = self.engine.fail_all(ENGINE_FAILURE)
            self._stats = self.engine.stats()
        except Exception:  # nothing more to save: the streams below still end
            logger.exception("could not end the requests cleanly")
            outputs = []
        ended = {output.request_id for output in outputs}
        outputs += [_error_output(rid, ENGINE_FAILURE) for rid in request_ids if rid not in ended]
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # RuntimeError: the event loop closed between the check and the call.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                stream = self._streams.get(output.request_id)
                if stream is not None and output.finished:
                    del self._streams[output.request_id]
            if stream is not None:
                stream.put(output)


def _error_output(request_id: str, error: SequenceError) -> RequestOutput:
    return dataclasses.replace(_abort_output(request_id), finish_reason="error", error=error)


def _abort_output(request_id: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        token_ids=[],
        text="",
        finished=True,
        finish_reason="abort",
        num_prompt_tokens=0,
        num_generated_tokens=0,
    )
