"""The model runner: owns the per-slot KV rows, the sampler and the step.

It runs steps on a model that :func:`~slotserve.engine.core.model.prepare.prepare_model` set up
(the loader builds one per engine; a benchmark several on one prepared model): one packed
forward per step for any mix of prefill chunks and decodes, through the native step, the
transformers model with the slot attention, or the static step. Logits are computed only at the
last position of each sequence that samples this step: the output projection (49152 x 576 for
SmolLM2) would otherwise dominate prefill.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.generation_defaults import eos_token_ids
from slotserve.engine.core.logprobs import SampledLogprobs
from slotserve.engine.core.model.attention import SlotStep
from slotserve.engine.core.model.calibration import CalibrationRecord
from slotserve.engine.core.model.kv_dtype import dtype_name
from slotserve.engine.core.model.prepare import PreparedModel
from slotserve.engine.core.model.prompt_logprobs import record_prompt_logprobs
from slotserve.engine.core.model.sampling import Sampler
from slotserve.engine.core.model.static_decoder import LaunchedStep, StaticDecoder, serves
from slotserve.engine.core.model.step_inputs import (
    StepRows,
    decode_inputs,
    prefill_inputs,
    step_rows,
)
from slotserve.engine.core.prefix_cache import SlotCopy
from slotserve.engine.core.scheduler import ScheduledChunk
from slotserve.engine.core.sequence import SequenceError


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
            vocab_size=config.vocab_size,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def sliding_window(config: Any) -> int | None:
    """The window of the model's sliding-window attention layers, or None when every layer
    attends to the whole context (the window unset, switched off, or no layer of that type)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and all(kind == "full_attention" for kind in layer_types):
        return None
    return int(window)


def check_window(config: Any, max_model_len: int) -> None:
    """Refuse a context longer than the model's sliding attention window: the slot attention
    attends to the whole row, so past the window it would answer differently from the model."""
    window = sliding_window(config)
    if window is not None and max_model_len > window:
        raise UnsupportedSettingError(
            f"max_model_len {max_model_len} exceeds the model's sliding attention window "
            f"({window}); set max_model_len to {window} or less"
        )


class ModelRunner:
    """Runs steps of packed chunks against a pre-allocated per-slot KV cache."""

    def __init__(
        self,
        prepared: PreparedModel,
        *,
        num_slots: int,
        max_model_len: int,
        max_rows: int | None = None,
        static_warm_up: bool = True,
        overlap_steps: bool = False,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``num_slots`` KV rows of ``max_model_len`` positions on ``prepared``'s device, of
        which at most ``max_rows`` (default all) decode in one step: rows beyond are prefix
        cache (``prefix_cache_rows``);
        ``overlap_steps``: the engine launches static steps before collecting the previous
        one's; ``static_warm_up``: compile the static step's buckets now (benchmarks compile
        the one they use); ``kv_dtype``: the cache's (default the weights'; float16 only where
        the native kernels run, kv_dtype.py)."""
        model = prepared.model
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_dtype or self.dtype
        self.shape = ModelShape.from_config(model.config)
        check_window(model.config, max_model_len)
        self.num_slots = num_slots
        self.max_rows = min(num_slots, max_rows or num_slots)
        self.max_model_len = max_model_len
        self.decoder = model.get_decoder()
        self.decode_step = prepared.decode_step
        static = prepared.static
        if overlap_steps and not static:
            raise UnsupportedSettingError("overlap_steps needs decode_step static or compiled")
        self.overlap_steps = overlap_steps
        # The engine's own kernels (CPU, fp32, a C compiler): decode attention over the slot
        # rows in place. None: torch only.
        self.native = prepared.kernels
        self.logits = prepared.logits
        self.calibrations: list[CalibrationRecord] = prepared.calibrations
        # The static step's padding rows write into one more row (scratch), never read back.
        num_rows = num_slots + 1 if static else num_slots
        cache_shape = (num_rows, self.shape.num_kv_heads, max_model_len, self.shape.head_dim)
        # torch.empty: on a CPU, pages are only committed as positions get written.
        self.k_cache = [self._empty(cache_shape) for _ in range(self.shape.num_layers)]
        self.v_cache = [self._empty(cache_shape) for _ in range(self.shape.num_layers)]
        # Decode rows and prefill chunks in one native call where the model's layers allow it.
        self.native_step = prepared.native_step(self.k_cache, self.v_cache)
        self.bf16_gate = prepared.bf16_gate
        self.prefill_bf16 = prepared.bf16_prefill
        self.decode_bf16 = prepared.bf16_decode
        # Steps that score a prompt run in fp32; benchmarks of the bf16 path's quality
        # (bench/quant_quality.py) score in bf16 instead.
        self.bf16_scoring = False
        self._arange = torch.arange(max_model_len, device=self.device)
        # Attention reads cache rows up to the longest decode of the step, past what each row
        # holds; masked positions still enter ``0 * value``, so they must hold finite numbers.
        # Rows are zeroed lazily in blocks, which also keeps untouched CPU pages uncommitted.
        self._num_finite = [0] * num_slots
        # min_tokens bans the model's EOS ids (the tokenizer's equal them for the models served).
        eos_ids = frozenset(eos_token_ids(model, None))
        self.sampler = Sampler(num_slots, self.shape.vocab_size, self.device, eos_ids)
        self.static: StaticDecoder | None = None
        self.num_split_steps = 0  # steps whose decodes ran static beside a classic forward
        if static:
            self.static = StaticDecoder(
                model,
                self.k_cache,
                self.v_cache,
                num_slots=num_slots,
                max_rows=self.max_rows,
                max_model_len=max_model_len,
                eos_token_ids=eos_ids,
                compile=prepared.decode_step == "compiled",
            )
            # On CUDA the sampling graphs too: a first sampled request would otherwise wait for
            # a compile of the whole model.
            if static_warm_up:  # benchmarks skip it: they compile the buckets they use
                self.static.warm_up(full=self.device.type == "cuda")
        # Per sampling chunk of the last step: its logprobs, for rows that asked (else None).
        self.last_logprobs: list[SampledLogprobs | None] = []

    @property
    def kv_cache_dtype(self) -> str:
        """The cache's dtype as ``/load`` and the load log spell it (``float16``, ...)."""
        return dtype_name(self.kv_dtype)

    @property
    def device_type(self) -> str:
        """``cpu``, ``cuda`` or ``mps``: where the model runs."""
        return self.device.type

    def _ensure_finite(self, rows: Iterable[int], kv_len: int) -> None:
        """Zero ``rows`` of the cache from their finite extent up to ``kv_len`` (rounded up to
        a block). Invariant: past a row's extent nothing valid was ever written, so zeroing
        there never destroys keys or values."""
        block = 256
        target = min(self.max_model_len, -(-kv_len // block) * block)
        for row in rows:
            start = self._num_finite[row]
            if start >= kv_len:
                continue
            for cache in (*self.k_cache, *self.v_cache):
                cache[row, :, start:target].zero_()
            self._num_finite[row] = target

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.kv_dtype, device=self.device)

    @torch.inference_mode()
    def copy_prefixes(self, copies: Seq[SlotCopy]) -> None:
        """Copy prefix rows between slots (prefix caching), in order, before the forward."""
        for copy in copies:
            n = copy.num_tokens
            for cache in (*self.k_cache, *self.v_cache):
                cache[copy.dst_slot, :, :n] = cache[copy.src_slot, :, :n]
            # Positions [0, n) are finite now; the row's lazy zeroing must start past them.
            self._num_finite[copy.dst_slot] = max(self._num_finite[copy.dst_slot], n)

    @torch.inference_mode()
    def execute(self, chunks: Seq[ScheduledChunk]) -> list[int | SequenceError]:
        """Run one step; returns, per chunk that samples (in chunk order), the sampled token or
        why that sequence has none. Raises only when the step as a whole fails."""
        # A step that samples nothing (a prefill chunk alone) must not leave the previous
        # step's logprobs for the engine to pair with this step's (empty) samples.
        self.last_logprobs = []
        if not chunks:
            return []
        if self.static is not None:
            decodes = [chunk for chunk in chunks if self._static_row(chunk)]
            if len(decodes) == len(chunks):
                return self._static_decode(chunks)
            if decodes:
                return self._split(chunks, decodes)
        return self._classic(chunks)

    def _classic(self, chunks: Seq[ScheduledChunk]) -> list[int | SequenceError]:
        """One forward of every chunk (native step or transformers), the eager sampler."""
        scoring = any(chunk.seq.prompt_logprobs is not None for chunk in chunks)
        if self.bf16_gate is not None:
            # A step with a prefill chunk multiplies as prefill_dtype says (bf16_prefill.py),
            # a decode-only step as decode_dtype says (bf16_decode.py); one that scores its
            # prompt runs in fp32 throughout.
            prefill = any(chunk.num_tokens > 1 for chunk in chunks)
            wanted = self.prefill_bf16 if prefill else self.decode_bf16
            self.bf16_gate.on = wanted and (self.bf16_scoring or not scoring)
        if self._natively(chunks):
            hidden, sample_index = self._native_decode(chunks)
        else:
            hidden, sample_index = self._transformers_forward(chunks)
        if scoring:
            record_prompt_logprobs(chunks, hidden, self.logits)  # from this forward's rows
        if not sample_index:
            return []
        index = torch.tensor(sample_index, device=self.device)
        logits = self.logits(hidden.index_select(0, index))
        sampling = [chunk for chunk in chunks if chunk.samples]
        result = self.sampler.sample(logits, [chunk.seq for chunk in sampling])
        samples, self.last_logprobs = result.tokens, result.logprobs
        for chunk, sample in zip(sampling, samples, strict=True):
            if isinstance(sample, SequenceError) and chunk.seq.slot is not None:
                # Its keys and values may hold NaN, which masked attention turns into NaN
                # (0 * NaN): zero the row again before the slot's next owner reads it.
                self._num_finite[chunk.seq.slot] = 0
        return samples

    @staticmethod
    def _static_row(chunk: ScheduledChunk) -> bool:
        return (
            chunk.num_tokens == 1
            and chunk.samples
            and chunk.seq.prompt_logprobs is None
            and serves(chunk.seq)
        )

    def _split(
        self, chunks: Seq[ScheduledChunk], decodes: list[ScheduledChunk]
    ) -> list[int | SequenceError]:
        """A step that mixes prefill chunks (or rows the device sampler does not serve) with
        static decode rows: the others run the classic way, the decodes through the static
        step (different slots: neither reads what the other writes); results in chunk order."""
        self.num_split_steps += 1
        static_ids = {id(chunk) for chunk in decodes}
        others = [chunk for chunk in chunks if id(chunk) not in static_ids]
        other_samples = iter(self._classic(others))
        other_logprobs = iter(self.last_logprobs or [None] * len(others))
        static_samples = iter(self._static_decode(decodes))
        static_logprobs = iter(self.last_logprobs)
        samples: list[int | SequenceError] = []
        logprobs: list[SampledLogprobs | None] = []
        for chunk in chunks:
            if not chunk.samples:
                continue
            static = id(chunk) in static_ids
            samples.append(next(static_samples if static else other_samples))
            logprobs.append(next(static_logprobs if static else other_logprobs))
        self.last_logprobs = logprobs
        return samples

    def _static_decode(self, chunks: Seq[ScheduledChunk]) -> list[int | SequenceError]:
        return self.collect(self.launch(chunks))

    def can_launch(self, chunks: Seq[ScheduledChunk], *, chained: bool = False) -> bool:
        """Whether every chunk is a decode row of the static step (a step :meth:`launch` can
        start without waiting for its result); ``chained``: and its bucket runs without a
        compile first (a compile's padding rows would overwrite the previous step's tokens)."""
        static = self.static
        if static is None or not chunks or not all(map(self._static_row, chunks)):
            return False
        if not chained:
            return True
        seqs = [chunk.seq for chunk in chunks]
        return static.is_ready(static.key_for(seqs, [chunk.start for chunk in chunks]))

    @torch.inference_mode()
    def launch(
        self, chunks: Seq[ScheduledChunk], previous_rows: Seq[int] | None = None
    ) -> LaunchedStep:
        """Start a static step of decode ``chunks`` (see :meth:`StaticDecoder.launch` for
        ``previous_rows``); :meth:`collect` returns its samples."""
        assert self.static is not None
        for chunk in chunks:
            if chunk.seq.slot is None:
                raise RuntimeError(f"sequence {chunk.seq.request_id} is scheduled without a slot")
        positions = [chunk.start for chunk in chunks]
        seqs = [chunk.seq for chunk in chunks]
        # Each row attends up to its span bucket: those positions must hold finite numbers.
        span = min(self.max_model_len, self.static.span_for(max(positions) + 1))
        self._ensure_finite(range(max(seq.slot or 0 for seq in seqs) + 1), span)
        return self.static.launch(seqs, positions, previous_rows)

    def collect(self, launched: LaunchedStep) -> list[int | SequenceError]:
        """A launched step's samples, one per chunk (its logprobs in ``last_logprobs``)."""
        assert self.static is not None
        samples, self.last_logprobs = self.static.collect(launched)
        for slot, sample in zip(launched.slots, samples, strict=True):
            if isinstance(sample, SequenceError):
                self._num_finite[slot] = 0  # as in execute(): NaN keys may be in the row
        return samples

    def _natively(self, chunks: Seq[ScheduledChunk]) -> bool:
        # Decode rows and prefill chunks alike (native_decode.NativeDecodeStep.takes decides).
        return self.native_step is not None and self.native_step.takes(
            [chunk.num_tokens for chunk in chunks]
        )

    def _transformers_forward(self, chunks: Seq[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        rows = step_rows(chunks)
        # Before this step writes anything: positions past a row's zeroed extent were never
        # written, so zeroing them cannot destroy keys or values.
        # The decode attention reads every row below the step's highest slot (masked).
        self._ensure_finite(range(max(rows.slots) + 1), max(rows.positions) + 1)
        positions = torch.tensor(rows.positions, device=self.device)
        hidden = self.decoder(
            input_ids=torch.tensor(rows.token_ids, device=self.device).unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            slot_step=self._slot_step(rows, positions),
        ).last_hidden_state[0]
        return hidden, rows.sample_index

    def _native_decode(self, chunks: Seq[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        assert self.native_step is not None
        rows = step_rows(chunks)
        # The native step reads each row only up to its own position, but the rows it writes
        # must keep the extent invariant (a later torch step zeroes past it); other rows are
        # left to the step that reads them (a 1,000-token prompt on slot 31 zeroed 32 rows,
        # ~1.1 GB for SmolLM2, ~0.2 s).
        self._ensure_finite(sorted(set(rows.slots)), max(rows.positions) + 1)
        hidden = self.native_step(rows.token_ids, rows.positions, rows.slots)
        return hidden, rows.sample_index

    def _slot_step(self, rows: StepRows, positions: torch.Tensor) -> SlotStep:
        """What the slot attention reads in each layer: where the rows write their keys and
        values, the decode rows' lengths (or mask) and the prefill chunks' masks."""
        device = self.device
        decode = decode_inputs(
            rows, native=self.native is not None, arange=self._arange, dtype=self.dtype,
            device=device,
        )  # fmt: skip
        group = self.model.config.num_attention_heads // self.shape.num_kv_heads
        has_decodes = bool(rows.decode_slots)
        return SlotStep(
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            write_slots=torch.tensor(rows.slots, device=device),
            write_positions=positions,
            num_tokens=len(rows.token_ids),
            decode_token_index=(
                torch.tensor(rows.decode_token_index, device=device) if has_decodes else None
            ),
            decode_slots=torch.tensor(rows.decode_slots, device=device) if has_decodes else None,
            num_decode_rows=decode.num_rows,
            decode_kv_len=decode.kv_len,
            decode_mask=decode.mask,
            prefills=prefill_inputs(rows, arange=self._arange, group=group),
            decode_lens=decode.native_lens,
            native=self.native if decode.native_lens is not None else None,
        )
