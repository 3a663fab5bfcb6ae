"""Runs decode steps through :func:`static_step.decode_step`: buckets, compilation, warm-up.

Per step: pick the bucket of rows (1, 2, 4, ... slots) and of attended positions, stage every
row's inputs in that bucket's host block, copy it to the device in one transfer, run the step
(compiled per bucket: ``mode="reduce-overhead"`` on CUDA records a CUDA graph for each), read the
result back in one transfer, started at launch and waited for at :meth:`StaticDecoder.collect`
(overlapped steps launch the next step in between). Warm-up at load compiles the greedy graph
of every row bucket at the shortest span; the others compile on first use. Both are counted
(``num_compiles``).

Which rows it serves: decodes whose sampling :mod:`device_sampling` does (greedy, temperature,
top_k/top_p/min_p, seeds, logprobs, the three penalties, min_tokens without stop_token_ids).
logit_bias and grammars keep the eager sampler (the runner's transformers path) for that step.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from slotserve.engine.core.logprobs import SampledLogprobs
from slotserve.engine.core.model.device_penalties import PenaltyRows
from slotserve.engine.core.model.device_sampling import seed_column
from slotserve.engine.core.model.sampling import NON_FINITE_LOGITS
from slotserve.engine.core.model.static_buffers import (
    BAN_EOS,
    FLAGS,
    FREQUENCY,
    FROM_HOST,
    GREEDY,
    MIN_P,
    POSITION,
    PRESENCE,
    PREVIOUS_ROW,
    PROMPT_LEN,
    REPETITION,
    SEED,
    SLOT,
    TEMPERATURE,
    TOKEN,
    TOP_K,
    TOP_P,
    PendingResult,
    StepBuffers,
    Transfers,
    bucket_sizes,
    kv_buckets,
    pick,
)
from slotserve.engine.core.model.static_step import StaticModel, decode_step, static_model
from slotserve.engine.core.params import MAX_LOGPROBS
from slotserve.engine.core.sequence import SequenceError

if TYPE_CHECKING:
    from slotserve.engine.core.sequence import Sequence

logger = logging.getLogger(__name__)

StepKey = tuple[int, int, bool]  # (rows bucket, kv bucket, full sampling)


@dataclass
class StaticStats:
    num_compiles: int = 0  # graphs compiled (warm-up included); CUDA graphs recorded with them
    compile_seconds: float = 0.0
    num_compile_failures: int = 0  # those buckets run eagerly (logged)
    warm_up_seconds: float = 0.0
    num_steps: int = 0
    steps_per_bucket: dict[StepKey, int] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A static step on its way: its rows' sequences and its result's copy to the host."""

    seqs: list[Sequence]
    slots: list[int]  # at launch (a row's sequence may have left its slot by the collect)
    key: StepKey
    pending: PendingResult


def serves(seq: Sequence) -> bool:
    """Whether the device sampler samples ``seq`` exactly as the eager sampler's rules say."""
    params = seq.params
    min_tokens_active = bool(params.min_tokens) and seq.num_generated_tokens < params.min_tokens
    return (
        seq.matcher is None
        and not params.logit_bias
        and not (min_tokens_active and params.stop_token_ids)
    )


class StaticDecoder:
    """The static step over the runner's cache (``num_slots + 1`` rows: the last is scratch)."""

    def __init__(
        self,
        model: Any,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        *,
        num_slots: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        compile: bool,
        backend: str = "inductor",
        max_rows: int | None = None,
    ) -> None:
        """``max_rows``: rows one step decodes at most (default ``num_slots``; fewer when the
        cache keeps spare prefix rows); ``backend``: torch.compile's; tests pass ``eager`` to
        prove the capture (graph breaks, recompiles) without the minutes inductor's C++ takes
        on a small CPU."""
        self.model: StaticModel = static_model(model)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.device = k_cache[0].device
        self.scratch_slot = num_slots
        if k_cache[0].shape[0] != num_slots + 1:
            raise ValueError("the static step needs a cache of num_slots + 1 rows (scratch)")
        for cache in (*k_cache, *v_cache):
            cache[self.scratch_slot].zero_()
        # Buckets by the rows a step decodes, not the rows the cache holds (spare prefix rows
        # would only add graphs that never run).
        max_rows = min(num_slots, max_rows or num_slots)
        self.row_buckets = bucket_sizes(max_rows)
        self.kv_buckets = kv_buckets(max_model_len)
        self.buffers = {rows: StepBuffers.allocate(rows, self.device) for rows in self.row_buckets}
        vocab_size = model.config.vocab_size
        self.eos_mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        ids = [token_id for token_id in eos_token_ids if token_id < vocab_size]
        if ids:
            self.eos_mask[torch.tensor(ids, device=self.device)] = True
        self.num_top = min(MAX_LOGPROBS, vocab_size)
        self.penalties = PenaltyRows(num_slots + 1, vocab_size, self.device)
        self.kv_positions = {
            span: torch.arange(span, device=self.device) for span in self.kv_buckets
        }
        # Each step's sampled tokens, on the device, for the next step's chained rows.
        self.last_tokens = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        self.transfers = Transfers()
        self.stats = StaticStats()
        self.compiled = compile
        self.backend = backend
        self._steps: dict[StepKey, Callable[..., torch.Tensor]] = {}
        if compile:
            self._prepare_compile()

    def _prepare_compile(self) -> None:
        import torch._dynamo

        # One compiled entry per (rows, span, mode) key of the same function: dynamo's limit
        # of entries per code object (8) would fall back to eager past it.
        keys = len(self.row_buckets) * len(self.kv_buckets) * 2
        config: Any = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, keys + 8)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * keys)
        if self.device.type == "cuda":
            # Graph replays write the cache in place: it and the input blocks must keep their
            # addresses (no copy into graph-owned memory) for the writes to land.
            penalties = (self.penalties.prompt_seen, self.penalties.output_counts)
            static = (*self.k_cache, *self.v_cache, self.eos_mask, self.last_tokens, *penalties)
            for tensor in static:
                torch._dynamo.mark_static_address(tensor)
            for buffers in self.buffers.values():
                torch._dynamo.mark_static_address(buffers.device_block)
            for positions in self.kv_positions.values():
                torch._dynamo.mark_static_address(positions)

    def _step(self, key: StepKey) -> Callable[..., torch.Tensor]:
        step = self._steps.get(key)
        if step is not None:
            return step
        rows, span, full = key
        buffers = self.buffers[rows]
        eager = partial(
            decode_step,
            self.model,
            self.k_cache,
            self.v_cache,
            buffers.device_block,
            buffers.device_floats,
            self.eos_mask,
            self.penalties.prompt_seen,
            self.penalties.output_counts,
            self.kv_positions[span],
            self.last_tokens,
            full,
            self.num_top,
        )
        if not self.compiled:
            self._steps[key] = eager
            return eager
        cuda_graphs = self.device.type == "cuda" and self.backend == "inductor"
        mode = "reduce-overhead" if cuda_graphs else None
        compiled = torch.compile(
            eager, fullgraph=True, dynamic=False, mode=mode, backend=self.backend
        )

        def run() -> torch.Tensor:
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            return compiled()

        start = time.perf_counter()
        # The compiling calls run the step: on padding rows only, which write the scratch slot
        # (whatever the block held last would write those rows' keys and counts again).
        buffers.stage({TOKEN: []}, {}, self.scratch_slot)
        self.transfers.to_device(buffers.host_block, buffers.device_block)
        try:
            run()  # compiles (and on CUDA warms, then records the graph on a later call)
            if self.device.type == "cuda":
                run()
                # Once per bucket: the padding rows' copy in must be done before the next
                # staging reuses its host block (overlapped steps wait only for results).
                torch.cuda.synchronize(self.device)
        except Exception:  # a compiler fault must not take the engine down: run it eagerly
            logger.exception(
                "compiling the static decode step for %d rows failed; it runs eagerly", rows
            )
            self.stats.num_compile_failures += 1
            self._steps[key] = eager
            return eager
        self.stats.num_compiles += 1
        self.stats.compile_seconds += time.perf_counter() - start
        logger.info(
            "compiled the static decode step for %d rows, %d positions, %s sampling in %.1f s",
            rows,
            span,
            "full" if full else "greedy",
            time.perf_counter() - start,
        )
        self._steps[key] = run
        return run

    @torch.inference_mode()  # as execute(): grad mode is in every compiled graph's guards
    def warm_up(self, *, full: bool = False) -> None:
        """Compile (or, eager, run once) the greedy step of every row bucket at the shortest
        span, and with ``full`` the sampling one too: padding rows only, which touch nothing
        but the scratch slot."""
        start = time.perf_counter()
        span = self.kv_buckets[0]
        for mode in (False, True) if full else (False,):
            for rows in self.row_buckets:
                step = self._step((rows, span, mode))  # compiling stages padding rows
                buffers = self.buffers[rows]
                buffers.stage({TOKEN: []}, {}, self.scratch_slot)
                self.transfers.to_device(buffers.host_block, buffers.device_block)
                self.transfers.to_host(step())
        self.stats.warm_up_seconds += time.perf_counter() - start

    def span_for(self, num_positions: int) -> int:
        """The attended span (a bucket) for rows reaching ``num_positions``."""
        return pick(self.kv_buckets, num_positions)

    def key_for(self, seqs: Seq[Sequence], positions: Seq[int]) -> StepKey:
        """The (rows, span, sampling) bucket a step of these rows runs in."""
        full = not all(
            p.is_greedy and p.logprobs is None and not p.has_penalties
            for p in (seq.params for seq in seqs)
        )
        return pick(self.row_buckets, len(seqs)), self.span_for(max(positions) + 1), full

    def is_ready(self, key: StepKey) -> bool:
        """Whether ``key``'s step runs without compiling first (a compile runs the step on
        padding rows, which would overwrite the tokens a chained step reads)."""
        return not self.compiled or key in self._steps

    @torch.inference_mode()
    def run(
        self, seqs: Seq[Sequence], positions: Seq[int]
    ) -> tuple[list[int | SequenceError], list[SampledLogprobs | None]]:
        """One decode token for each ``seqs[i]`` at ``positions[i]`` (its slot's next row)."""
        return self.collect(self.launch(seqs, positions))

    @torch.inference_mode()
    def launch(
        self,
        seqs: Seq[Sequence],
        positions: Seq[int],
        previous_rows: Seq[int] | None = None,
    ) -> LaunchedStep:
        """Start the step and the copy of its result; returns without waiting for the device.
        ``previous_rows[i]``: the row of the step launched just before whose sampled token is
        row ``i``'s input (not yet in ``seqs[i].token_ids``), or ``FROM_HOST``."""
        sources = list(previous_rows) if previous_rows is not None else [FROM_HOST] * len(seqs)
        ints: dict[int, list[int]] = {TOKEN: [], POSITION: list(positions), SLOT: [], TOP_K: []}
        ints[SEED], ints[FLAGS], ints[PROMPT_LEN], ints[PREVIOUS_ROW] = [], [], [], sources
        floats: dict[int, list[float]] = {TEMPERATURE: [], TOP_P: [], MIN_P: []}
        floats[REPETITION], floats[FREQUENCY], floats[PRESENCE] = [], [], []
        for seq, position, source in zip(seqs, positions, sources, strict=True):
            params = seq.params
            assert seq.slot is not None  # the runner refuses slotless chunks first
            chained = source != FROM_HOST
            ints[TOKEN].append(0 if chained else seq.token_ids[position])
            ints[SLOT].append(seq.slot)
            greedy = params.is_greedy
            num_generated = seq.num_generated_tokens + chained  # the chained token counts
            ban = (
                bool(params.min_tokens)
                and num_generated < params.min_tokens
                and not params.ignore_eos
            )
            ints[FLAGS].append((GREEDY if greedy else 0) | (BAN_EOS if ban else 0))
            seed = params.seed if params.seed is not None else secrets.randbits(32)
            ints[SEED].append(seed_column(seed))
            ints[TOP_K].append(0 if greedy else params.top_k or 0)
            floats[TEMPERATURE].append(1.0 if greedy else params.temperature)
            floats[TOP_P].append(1.0 if greedy else params.top_p)
            floats[MIN_P].append(0.0 if greedy else params.min_p)
            ints[PROMPT_LEN].append(seq.num_prompt_tokens)
            floats[REPETITION].append(params.repetition_penalty)
            floats[FREQUENCY].append(params.frequency_penalty)
            floats[PRESENCE].append(params.presence_penalty)
        key = self.key_for(seqs, positions)
        step = self._step(key)  # first, as a compile runs the step on padding rows
        if key[2]:
            self.penalties.prepare(seqs, positions, self.transfers)
        buffers = self.buffers[key[0]]
        buffers.stage(ints, floats, self.scratch_slot)
        self.transfers.to_device(buffers.host_block, buffers.device_block)
        pending = self.transfers.start_to_host(step())
        self.stats.num_steps += 1
        self.stats.steps_per_bucket[key] = self.stats.steps_per_bucket.get(key, 0) + 1
        slots = [seq.slot for seq in seqs if seq.slot is not None]
        return LaunchedStep(list(seqs), slots, key, pending)

    def collect(
        self, launched: LaunchedStep
    ) -> tuple[list[int | SequenceError], list[SampledLogprobs | None]]:
        """Wait for a launched step's result: per row, the token (or why none) and logprobs."""
        return self._unpack(launched.seqs, self.transfers.wait_to_host(launched.pending))

    def _unpack(
        self, seqs: Seq[Sequence], result: list[list[float]]
    ) -> tuple[list[int | SequenceError], list[SampledLogprobs | None]]:
        tokens: list[int | SequenceError] = []
        logprobs: list[SampledLogprobs | None] = []
        top = self.num_top
        for seq, row in zip(seqs, result, strict=False):
            if not row[1]:
                tokens.append(NON_FINITE_LOGITS)
                logprobs.append(None)
                continue
            token = int(row[0])
            tokens.append(token)
            n = seq.params.logprobs
            if n is None:
                logprobs.append(None)
                continue
            ids, values = row[3 : 3 + top], row[3 + top : 3 + 2 * top]
            pairs = tuple((int(i), v) for i, v in zip(ids[:n], values[:n], strict=True))
            logprobs.append(SampledLogprobs(token_id=token, logprob=row[2], top=pairs))
        return tokens, logprobs
