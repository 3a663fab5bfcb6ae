"""The synchronous engine: ``step()`` = schedule, run the model, postprocess.

Usable directly in tests and benchmarks; :mod:`slotserve.engine.core.async_engine` drives it from a
thread for the HTTP server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from slotserve.engine.core.detokenizer import IncrementalDetokenizer, TokenTexts
from slotserve.engine.core.errors import InvalidRequestError
from slotserve.engine.core.generation_defaults import GenerationDefaults, eos_token_ids
from slotserve.engine.core.kv_cache import KVCacheManager
from slotserve.engine.core.limits import RequestLimits
from slotserve.engine.core.overlap import Collected, StepOverlap
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.protocols import Runner, Tokenizer
from slotserve.engine.core.scheduler import Scheduler, SchedulerConfig, StepPlan
from slotserve.engine.core.sequence import Sequence, SequenceError
from slotserve.engine.core.stats import (
    EngineStats,
    FinishedRequest,
    RequestMetrics,
    RequestOutput,
    StepRecord,
)
from slotserve.engine.core.structured import GrammarError, Grammars
from slotserve.engine.settings import EngineSettings

logger = logging.getLogger(__name__)


@dataclass
class _Counters:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    sequence_failures: Counter[str] = field(default_factory=Counter)
    records: list[StepRecord] | None = field(default=None)


class LLMEngine:
    """Validates requests, steps the scheduler and the model runner, and emits outputs."""

    def __init__(
        self,
        settings: EngineSettings,
        runner: Runner,
        tokenizer: Tokenizer,
        *,
        kv_cache_tokens: int,
        model_name: str,
        clock: Callable[[], float] = time.monotonic,
        record_steps: bool = False,
        generation_defaults: GenerationDefaults | None = None,
    ) -> None:
        self.settings = settings
        # Defaults for request fields left out (the HTTP layer applies them; see the module).
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len: int = runner.max_model_len
        self.vocab_size: int = runner.shape.vocab_size
        self.clock = clock
        # The runner's rows are the slots (fewer than max_batch_size when the memory budget holds
        # fewer rows), unless prefix_cache_rows gave it spare rows: then max_batch_size run.
        num_rows = runner.num_slots
        spare = settings.prefix_cache_rows > settings.max_batch_size
        num_slots = min(settings.max_batch_size, num_rows) if spare else num_rows
        self.kv_cache = KVCacheManager(
            num_slots=num_slots,
            num_tokens_total=kv_cache_tokens,
            enable_prefix_caching=settings.enable_prefix_caching,
            num_rows=num_rows,
        )
        self.limits = RequestLimits(
            max_model_len=self.max_model_len,
            kv_cache_tokens=self.kv_cache.num_tokens_total,
            vocab_size=self.vocab_size,
            num_slots=num_slots,
            max_waiting=settings.max_waiting,
        )
        config = SchedulerConfig(
            policy=settings.policy,
            max_batch_size=num_slots,
            max_batched_tokens=settings.step_token_budget(runner.device_type),
            max_queue_delay_seconds=settings.max_queue_delay_microseconds / 1e6,
            preferred_batch_sizes=tuple(settings.preferred_batch_sizes),
        )
        self.scheduler = Scheduler(
            config, self.kv_cache, eos_token_ids=eos_token_ids(runner.model, tokenizer)
        )
        # Requests are tokenized on the caller's thread while the loop thread detokenizes; the
        # Rust tokenizer raises "Already borrowed" if a mutable call overlaps another call.
        self.tokenizer_lock = threading.Lock()
        self._sequences: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._counters = _Counters(records=[] if record_steps else None)
        self._token_texts = TokenTexts(tokenizer)  # for logprobs: token id -> text, cached
        # Structured output: checked grammars and matchers (its tokenizer view is built once,
        # under the tokenizer lock).
        self.grammars = Grammars(tokenizer, self.tokenizer_lock)
        # Static decode steps launched before the previous one is postprocessed (the runner's
        # overlap_steps setting).
        self.overlap = StepOverlap(self.scheduler, runner) if runner.overlap_steps else None

    @classmethod
    def load(cls, settings: EngineSettings, **kwargs: Any) -> LLMEngine:
        """Load the model named in ``settings`` and size the KV cache (blocking, seconds); see
        :mod:`slotserve.engine.core.model.loader`."""
        from slotserve.engine.core.model.loader import load_engine_parts

        parts = load_engine_parts(settings)
        kwargs.setdefault("generation_defaults", parts.generation_defaults)
        return cls(
            settings,
            parts.runner,
            parts.tokenizer,
            kv_cache_tokens=parts.kv_cache_tokens,
            model_name=parts.model_name,
            **kwargs,
        )

    # -- requests ---------------------------------------------------------------------------

    def make_sequence(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Sequence:
        """Validate a request (raising :class:`InvalidRequestError`) without enqueueing it."""
        limits = self.limits
        if isinstance(prompt, str):
            limits.check_not_empty(prompt)
            token_ids = self.encode(prompt)
        else:
            token_ids = list(prompt)
            limits.check_prompt_ids(token_ids)
        limits.check_not_empty(token_ids)
        limits.check_length(len(token_ids), params.max_tokens)
        seq = Sequence(request_id, token_ids, params, arrival_time=self.clock())
        if params.grammar is not None:
            try:
                seq.matcher = self.grammars.matcher(params.grammar)
            except GrammarError as error:
                raise InvalidRequestError(str(error), param="response_format") from error
        return seq

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenize on any thread: the loop thread detokenizes at the same time."""
        with self.tokenizer_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Sequence:
        if request_id in self._sequences:
            raise InvalidRequestError(f"request id {request_id!r} is in use", param="request_id")
        self.limits.check_queue_room(len(self.scheduler.waiting))
        seq = self.make_sequence(request_id, prompt, params)
        self.enqueue(seq)
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Add an already validated sequence (the async engine validates on the caller's thread)."""
        if seq.request_id in self._sequences:
            raise InvalidRequestError(
                f"request id {seq.request_id!r} is in use", param="request_id"
            )
        # Built first: if it raises, nothing of the request is left behind.
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, stop=list(seq.params.stop)
        )
        self._sequences[seq.request_id] = seq
        self._detokenizers[seq.request_id] = detokenizer
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Abort a request; its slot is free at the next step (idempotent)."""
        if request_id in self._sequences:
            self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self._in_flight or self.scheduler.has_unfinished()

    def may_gather(self) -> bool:
        """See :meth:`Scheduler.may_gather`; never while an overlapped step is in flight."""
        return not self._in_flight and self.scheduler.may_gather()

    def next_step_delay(self) -> float:
        return 0.0 if self._in_flight else self.scheduler.next_step_delay(self.clock())

    @property
    def _in_flight(self) -> bool:
        return self.overlap is not None and self.overlap.in_flight is not None

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that advanced or finished.

        A failure that belongs to one sequence (its logits, its sampling, its text) ends that
        sequence with "error" and nothing else; an exception raised here means the step as a
        whole failed (the runner is broken): see :meth:`fail_all`. With overlapped steps
        (:mod:`slotserve.engine.core.overlap`) a static decode step's outputs come from the
        next call, which launches the step after it first.
        """
        outputs: list[RequestOutput] = []
        overlap = self.overlap
        if overlap is not None and overlap.in_flight is not None:
            done, chained = overlap.advance()
            outputs = self._postprocess(done)
            if chained:
                return outputs
        plan = self.scheduler.schedule(self.clock())
        outputs += [self._finish_output(seq, [], "") for seq in plan.aborted]
        if not plan.chunks:
            return outputs
        if plan.copies:
            self.runner.copy_prefixes(plan.copies)  # prefix cache: before the forward
        if overlap is not None and overlap.launch(plan):
            return outputs
        samples = self.runner.execute(plan.chunks)
        logprobs = list(self.runner.last_logprobs) or [None] * len(samples)
        return outputs + self._postprocess(Collected(plan, samples, logprobs))

    def _postprocess(self, done: Collected) -> list[RequestOutput]:
        plan, samples, now = done.plan, done.samples, self.clock()
        if self._counters.records is not None:
            self._record(plan, now)
        self.scheduler.postprocess(plan, samples, now)
        outputs = []
        with self.tokenizer_lock:
            for chunk, sample, sampled in zip(
                plan.sampling_chunks, samples, done.logprobs, strict=True
            ):
                output = self._sample_output(chunk.seq, sample, now)
                # A stop token adds no text, so it has no logprobs entry either (as OpenAI).
                if sampled is not None and output.token_ids and not self._is_stop_token(chunk.seq):
                    output.logprobs = [self._token_texts.decode(sampled)]
                if isinstance(sample, int) and chunk.seq.num_generated_tokens == 1:
                    self._attach_prompt_logprobs(chunk.seq, output)
                outputs.append(output)
        return outputs

    def _attach_prompt_logprobs(self, seq: Sequence, output: RequestOutput) -> None:
        """The prompt's logprobs ride on the first token's output (all computed by then)."""
        if seq.prompt_logprobs is None:
            return
        decode = self._token_texts.decode_prompt
        output.prompt_logprobs = [
            None if entry is None else decode(entry) for entry in seq.prompt_logprobs
        ]
        output.prompt_tokens = [self._token_texts(token_id) for token_id in seq.prompt_token_ids]

    def _is_stop_token(self, seq: Sequence) -> bool:
        params = seq.params
        token_id = seq.token_ids[-1]
        return token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.scheduler.eos_token_ids
        )

    def fail_all(self, error: SequenceError) -> list[RequestOutput]:
        """End every request the engine holds with ``error``, running nothing (after a step
        raised: its state is not trusted, so even requests that just finished are errors)."""
        now = self.clock()
        outputs = []
        if self.overlap is not None:
            self.overlap.forget()
        for seq in list(self._sequences.values()):
            if seq.finish_reason != "abort":
                self.scheduler.fail(seq, error, now)
            outputs.append(self._finish_output(seq, [], ""))
        return outputs

    def _sample_output(
        self, seq: Sequence, sample: int | SequenceError, now: float
    ) -> RequestOutput:
        if isinstance(sample, SequenceError):
            return self._finish_output(seq, [], "")  # postprocess has failed the sequence
        try:
            return self._token_output(seq, sample, now)
        except Exception as error:  # the detokenizer or stop strings: this request only
            failure = SequenceError(
                "detokenizer", f"decoding the output failed: {type(error).__name__}"
            )
            self.scheduler.fail(seq, failure, now)
            return self._finish_output(seq, [], "")

    def _token_output(self, seq: Sequence, token_id: int, now: float) -> RequestOutput:
        counters = self._counters
        counters.generation_tokens_total += 1
        if seq.num_generated_tokens == 1:
            counters.prompt_tokens_total += seq.num_prompt_tokens
        detokenizer = self._detokenizers[seq.request_id]
        stopped_by_token = seq.finish_reason == "stop"
        # A stop token ends the text without adding its own.
        delta = detokenizer.add_tokens(
            [] if stopped_by_token else [token_id], final=seq.is_finished
        )
        if delta.stopped and not seq.is_finished:
            self.scheduler.finish(seq, "stop", now)
        if seq.is_finished:
            return self._finish_output(seq, [token_id], delta.text)
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[token_id],
            text=delta.text,
            finished=False,
            finish_reason=None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_generated_tokens=seq.num_generated_tokens,
        )

    def _finish_output(self, seq: Sequence, token_ids: list[int], text: str) -> RequestOutput:
        self._sequences.pop(seq.request_id, None)
        self._detokenizers.pop(seq.request_id, None)
        if seq.error is not None:
            self._counters.sequence_failures[seq.error.reason] += 1
            # The request id only: prompts and outputs never reach the log.
            logger.warning(
                "request %s failed (%s): %s", seq.request_id, seq.error.reason, seq.error.message
            )
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=token_ids,
            text=text,
            finished=True,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_generated_tokens=seq.num_generated_tokens,
            metrics=RequestMetrics.from_sequence(seq),
            error=seq.error,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _record(self, plan: StepPlan, now: float) -> None:
        slots = {
            chunk.seq.slot: chunk.seq.request_id
            for chunk in plan.chunks
            if chunk.seq.slot is not None
        }
        assert self._counters.records is not None
        self._counters.records.append(StepRecord(plan.step, now, slots))

    @property
    def step_records(self) -> list[StepRecord]:
        return list(self._counters.records or [])

    # -- reporting --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        scheduler, prefix_cache = self.scheduler, self.kv_cache.prefix_cache
        return EngineStats(
            policy=self.settings.policy,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_slots_total=self.kv_cache.num_slots,
            num_slots_free=self.kv_cache.num_free_slots,
            num_kv_rows=self.kv_cache.num_rows,
            kv_cache_usage=self.kv_cache.usage,
            kv_cache_tokens_total=self.kv_cache.num_tokens_total,
            slot_utilisation=scheduler.slot_utilisation,
            num_steps=scheduler.num_steps,
            num_preemptions=scheduler.num_preemptions,
            num_tenant_preemptions=scheduler.num_tenant_preemptions,
            tenant_recomputed_tokens_total=scheduler.num_tenant_recomputed_tokens,
            prompt_tokens_total=self._counters.prompt_tokens_total,
            generation_tokens_total=self._counters.generation_tokens_total,
            sequence_failures=dict(self._counters.sequence_failures),
            prefix_cache_queries_total=self.kv_cache.num_prefix_query_tokens,
            prefix_cache_hits_total=self.kv_cache.num_prefix_hit_tokens,
            calibrations=tuple(self.runner.calibrations),
            kv_cache_dtype=self.runner.kv_cache_dtype,
            max_batched_tokens=scheduler.config.max_batched_tokens,
            row_request_ids=() if prefix_cache is None else prefix_cache.row_requests,
            row_idle_since=() if prefix_cache is None else prefix_cache.row_idle_since,
        )

    def generate(
        self,
        prompts: Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams],
    ) -> list[FinishedRequest]:
        """Run prompts to completion (all waiting at once); results in prompt order."""
        prompts = list(prompts)
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{i}-{id(self)}" for i in range(len(prompts))]
        seqs = [
            self.add_request(request_id, prompt, p)
            for request_id, prompt, p in zip(ids, prompts, all_params, strict=True)
        ]
        texts = dict.fromkeys(ids, "")
        metrics: dict[str, RequestMetrics | None] = {}
        while self.has_unfinished():
            for output in self.step():
                texts[output.request_id] += output.text
                if output.finished:
                    metrics[output.request_id] = output.metrics
        return [
            FinishedRequest(
                seq.request_id,
                seq.generated_token_ids,
                texts[seq.request_id],
                seq.finish_reason,
                metrics.get(seq.request_id),
                seq.num_preemptions,
            )
            for seq in seqs
        ]
