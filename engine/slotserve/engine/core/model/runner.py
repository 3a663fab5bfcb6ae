"""The model runner: the only module that touches torch and transformers model classes.

It loads an ``AutoModelForCausalLM`` and its tokenizer, owns the per-slot KV cache (allocated
once, written in place), and runs one packed forward per step for any mix of prefill chunks and
decodes. Logits are computed only at the last position of each sequence that samples this step:
the output projection (49152 x 576 for SmolLM2) would otherwise dominate prefill.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from slotserve.contracts.engine_argv import Quantization
from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.generation_defaults import eos_token_ids
from slotserve.engine.core.logprobs import SampledLogprobs
from slotserve.engine.core.memory import SYSTEM, MemorySources, size_kv_cache
from slotserve.engine.core.memory import available_memory_bytes as host_available_memory_bytes
from slotserve.engine.core.model.attention import (
    PrefillChunkInput,
    SlotStep,
    register_slot_attention,
)
from slotserve.engine.core.model.bf16_prefill import (
    bf16_units,
    install_bf16_prefill,
    wants_bf16_prefill,
)
from slotserve.engine.core.model.calibration import CalibrationCache, CalibrationRecord
from slotserve.engine.core.model.linear_setup import native_kernels, set_up_linears
from slotserve.engine.core.model.native_decode import native_step, step_eligible
from slotserve.engine.core.model.prompt_logprobs import record_prompt_logprobs
from slotserve.engine.core.model.quantize import preflight
from slotserve.engine.core.model.sampling import Sampler
from slotserve.engine.core.model.static_decoder import LaunchedStep, StaticDecoder, serves
from slotserve.engine.core.model.static_memory import (
    fuse_before_sizing,
    headroom_bytes,
    kv_budget_bytes,
)
from slotserve.engine.core.prefix_cache import SlotCopy
from slotserve.engine.core.protocols import Tokenizer
from slotserve.engine.core.scheduler import ScheduledChunk
from slotserve.engine.core.sequence import SequenceError
from slotserve.engine.settings import (
    DecodeStep,
    EngineSettings,
    LinearBackend,
    OverlapSteps,
    PrefillDType,
)
from slotserve.settings import CommonSettings

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_decode_step(decode_step: DecodeStep, device: torch.device) -> DecodeStep:
    """``auto``: the compiled static step on CUDA (graphs), the classic path elsewhere (the
    native C step is the fast one on a CPU)."""
    if decode_step == "auto":
        return "compiled" if device.type == "cuda" else "classic"
    return decode_step


def pick_overlap_steps(
    overlap: OverlapSteps, decode_step: DecodeStep, device: torch.device
) -> bool:
    """``auto``: on with the compiled step on CUDA, where the step is launched asynchronously
    and the host's postprocessing hides behind the device's work; off elsewhere (on a CPU the
    step runs on the calling thread, so there is nothing to hide behind: bench/overlap_bench.py
    measures it). ``on`` needs the static step (static or compiled)."""
    static = decode_step in ("static", "compiled")
    if overlap == "on" and not static:
        raise UnsupportedSettingError(
            f"overlap_steps on overlaps the static decode step: it needs decode_step static or "
            f"compiled (got {decode_step})"
        )
    if overlap == "auto":
        return decode_step == "compiled" and device.type == "cuda"
    return overlap == "on"


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # CPUs without bf16 units run fp32 fastest; GPUs run bf16.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[dtype]


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


def load_model(source: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Tokenizer]:
    """Load model and tokenizer from a local folder or hub id (already resolved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    # transformers' stubs type the wrapped `to` as taking the model itself, not a device.
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    # transformers types decode() and apply_chat_template() for every input shape and flag
    # (-> str | list[str]; messages as dict[str, str]); for the flat id lists, tokenize=False and
    # messages (with tool calls) the engine passes, they are what Tokenizer declares.
    return model, tokenizer  # type: ignore[return-value]


def available_memory_bytes(device: torch.device, sources: MemorySources) -> int:
    """Free memory on the device (GPU), or RAM this process may still use (CPU: the node's,
    capped by the container's cgroup limit)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_memory_bytes(sources)


class ModelRunner:
    """Runs steps of packed chunks against a pre-allocated per-slot KV cache."""

    def __init__(
        self,
        model: Any,
        *,
        num_slots: int,
        max_model_len: int,
        linear_backend: LinearBackend = "auto",
        calibration: CalibrationCache | None = None,
        quantization: Quantization = "none",
        use_native_kernels: bool = True,
        native_decode: bool = True,
        decode_step: DecodeStep = "classic",
        static_warm_up: bool = True,
        overlap_steps: bool = False,
        prefill_dtype: PrefillDType = "float32",
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.shape = ModelShape.from_config(model.config)
        window = sliding_window(model.config)
        if window is not None and max_model_len > window:
            # The slot attention attends to the whole row: past the window it would answer
            # differently from the model.
            raise UnsupportedSettingError(
                f"max_model_len {max_model_len} exceeds the model's sliding attention window "
                f"({window}); set max_model_len to {window} or less"
            )
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        model.set_attn_implementation(register_slot_attention())
        self.decoder = model.get_decoder()
        static = decode_step in ("static", "compiled")
        if overlap_steps and not static:
            raise UnsupportedSettingError("overlap_steps needs decode_step static or compiled")
        self.overlap_steps = overlap_steps
        if static:
            # The static step calls the model's own stock modules: no C kernels, no packing.
            if quantization != "none" or linear_backend not in ("auto", "aten"):
                raise UnsupportedSettingError(
                    f"decode_step {decode_step} runs stock products: it needs quantization none "
                    f"and linear_backend auto or aten (got {quantization}, {linear_backend})"
                )
            use_native_kernels, native_decode, linear_backend = False, False, "aten"
        # The engine's own kernels (CPU, fp32, a C compiler): decode attention over the slot
        # rows in place, and decode-sized products where they beat aten. False: torch only.
        self.native = native_kernels(self.device, self.dtype) if use_native_kernels else None
        # The CPU's bf16 units, read once: they decide whether prefill multiplies in bf16.
        units = bf16_units() if prefill_dtype != "float32" else []
        # The linear layers (native, quantized, oneDNN-packed or stock) and the logits layer.
        layers = set_up_linears(
            model,
            self.native,
            linear_backend=linear_backend,
            quantization=quantization,
            num_slots=num_slots,
            calibration=calibration,
            native_step=native_decode and self.native is not None and step_eligible(model),
            native_for_prefill=native_decode
            and step_eligible(model)
            and wants_bf16_prefill(prefill_dtype, quantization, units),
        )
        self.logits = layers.logits
        self.calibrations: list[CalibrationRecord] = layers.calibrations
        # The static step's padding rows write into one more row (scratch), never read back.
        num_rows = num_slots + 1 if static else num_slots
        cache_shape = (num_rows, self.shape.num_kv_heads, max_model_len, self.shape.head_dim)
        # torch.empty: on a CPU, pages are only committed as positions get written.
        self.k_cache = [self._empty(cache_shape) for _ in range(self.shape.num_layers)]
        self.v_cache = [self._empty(cache_shape) for _ in range(self.shape.num_layers)]
        # Decode-only steps in one native call where the model's layers allow it.
        self.native_step = (
            native_step(model, self.native, self.k_cache, self.v_cache) if native_decode else None
        )
        # bf16 prefill products: in the native step (its wide products call back into torch's
        # bf16 GEMM), else in the layers' torch path; decode-sized products stay fp32.
        self.bf16_gate = install_bf16_prefill(model, prefill_dtype, units)
        self.prefill_bf16 = self.bf16_gate is not None
        step, gate = self.native_step, self.bf16_gate
        if step is not None and gate is not None and not step.use_bf16_products(gate):
            step.prefill = False
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
                max_model_len=max_model_len,
                eos_token_ids=eos_ids,
                compile=decode_step == "compiled",
            )
            # On CUDA the sampling graphs too: a first sampled request would otherwise wait for
            # a compile of the whole model.
            if static_warm_up:  # benchmarks skip it: they compile the buckets they use
                self.static.warm_up(full=self.device.type == "cuda")
        # Per sampling chunk of the last step: its logprobs, for rows that asked (else None).
        self.last_logprobs: list[SampledLogprobs | None] = []

    def _ensure_finite(self, num_rows: int, kv_len: int) -> None:
        block = 256
        target = min(self.max_model_len, -(-kv_len // block) * block)
        for row in range(num_rows):
            start = self._num_finite[row]
            if start >= kv_len:
                continue
            for cache in (*self.k_cache, *self.v_cache):
                cache[row, :, start:target].zero_()
            self._num_finite[row] = target

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

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
            # bf16 for steps with a prefill chunk, unless one scores its prompt; decode-only
            # steps stay fp32, however many rows (bf16_prefill.py).
            prefill = any(chunk.num_tokens > 1 for chunk in chunks)
            self.bf16_gate.on = prefill and not scoring
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
        self._ensure_finite(max(seq.slot or 0 for seq in seqs) + 1, span)
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
        step, input_ids, positions, sample_index = self._prepare(chunks)
        hidden = self.decoder(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            slot_step=step,
        ).last_hidden_state[0]
        return hidden, sample_index

    def _native_decode(self, chunks: Seq[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        assert self.native_step is not None
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_index: list[int] = []
        for chunk in chunks:
            if chunk.seq.slot is None:
                raise RuntimeError(f"sequence {chunk.seq.request_id} is scheduled without a slot")
            end = chunk.start + chunk.num_tokens  # a prefill chunk: one row per token
            token_ids.extend(chunk.seq.token_ids[chunk.start : end])
            positions.extend(range(chunk.start, end))
            slots.extend([chunk.seq.slot] * chunk.num_tokens)
            if chunk.samples:
                sample_index.append(len(token_ids) - 1)
        # The torch path of a later step may read these rows up to its longest decode.
        self._ensure_finite(max(slots) + 1, max(positions) + 1)
        return self.native_step(token_ids, positions, slots), sample_index

    def _prepare(
        self, chunks: Seq[ScheduledChunk]
    ) -> tuple[SlotStep, torch.Tensor, torch.Tensor, list[int]]:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_index: list[int] = []
        decode_token_index: list[int] = []
        decode_slots: list[int] = []
        decode_lens: list[int] = []
        prefill_specs: list[tuple[int, int, int, int]] = []
        for chunk in chunks:
            seq = chunk.seq
            if seq.slot is None:
                raise RuntimeError(f"sequence {seq.request_id} is scheduled without a slot")
            token_start = len(token_ids)
            end = chunk.start + chunk.num_tokens
            token_ids.extend(seq.token_ids[chunk.start : end])
            positions.extend(range(chunk.start, end))
            slots.extend([seq.slot] * chunk.num_tokens)
            if chunk.num_tokens == 1:
                decode_token_index.append(token_start)
                decode_slots.append(seq.slot)
                decode_lens.append(end)
            else:
                prefill_specs.append((token_start, chunk.num_tokens, seq.slot, chunk.start))
            if chunk.samples:
                sample_index.append(len(token_ids) - 1)

        # Before this step writes anything: positions past a row's zeroed extent were never
        # written, so zeroing them cannot destroy keys or values.
        self._ensure_finite(max(slots) + 1, max(positions) + 1)
        device = self.device
        positions_t = torch.tensor(positions, device=device)
        decode_mask = native_lens = None
        num_rows = kv_len = 0
        if decode_slots:
            num_rows = max(decode_slots) + 1
            kv_len = max(decode_lens)
        if decode_slots and self.native is not None:
            row_lens = [0] * num_rows  # idle rows: no positions, zeros out, never read back
            for slot, length in zip(decode_slots, decode_lens, strict=True):
                row_lens[slot] = length
            native_lens = torch.tensor(row_lens, dtype=torch.long)
        elif decode_slots:
            lens = torch.zeros(num_rows, dtype=torch.long, device=device)
            # Rows of idle slots attend to position 0 only: finite garbage, never read back.
            lens.fill_(1)
            lens[torch.tensor(decode_slots, device=device)] = torch.tensor(
                decode_lens, device=device
            )
            decode_mask = (self._arange[:kv_len].unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
            if device.type == "cpu":
                decode_mask = torch.zeros(
                    decode_mask.shape, dtype=self.dtype, device=device
                ).masked_fill_(~decode_mask, float("-inf"))

        group = self.model.config.num_attention_heads // self.shape.num_kv_heads
        prefills = []
        for token_start, num_tokens, slot, start in prefill_specs:
            mask = None
            if start > 0:
                query_pos = self._arange[start : start + num_tokens].unsqueeze(1)
                causal = self._arange[: start + num_tokens].unsqueeze(0) <= query_pos
                mask = causal.repeat(group, 1)  # rows follow the (head-in-group, token) fold
            prefills.append(
                PrefillChunkInput(token_start, num_tokens, slot, start + num_tokens, mask)
            )

        step = SlotStep(
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            write_slots=torch.tensor(slots, device=device),
            write_positions=positions_t,
            num_tokens=len(token_ids),
            decode_token_index=(
                torch.tensor(decode_token_index, device=device) if decode_slots else None
            ),
            decode_slots=torch.tensor(decode_slots, device=device) if decode_slots else None,
            num_decode_rows=num_rows,
            decode_kv_len=kv_len,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
            decode_lens=native_lens,
            native=self.native if native_lens is not None else None,
        )
        return step, torch.tensor(token_ids, device=device), positions_t, sample_index


def build_runner(
    settings: EngineSettings, source: str, memory: MemorySources = SYSTEM
) -> tuple[ModelRunner, Tokenizer, int]:
    """Load the model for ``settings`` and size the KV cache.

    Returns the runner, the tokenizer and the KV capacity in tokens: ``kv_cache_tokens`` if
    set (never more than the slot rows hold), else as many slot rows of ``max_model_len`` as
    ``kv_cache_memory_fraction`` of the memory available after loading holds, at most
    ``max_batch_size`` (see :mod:`slotserve.engine.core.memory`). ``runner.num_slots`` is the
    number of slots.
    """
    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    load_start = time.perf_counter()
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    preflight(settings.quantization, device, dtype)
    model, tokenizer = load_model(source, device, dtype)
    decode_step = pick_decode_step(settings.decode_step, device)
    if decode_step in ("static", "compiled"):
        fuse_before_sizing(model)  # the free memory read below is then what stays free
    shape = ModelShape.from_config(model.config)
    max_model_len = settings.max_model_len or min(
        shape.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
    )
    if max_model_len > shape.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's "
            f"{shape.max_position_embeddings} positions"
        )
    available = (
        0 if settings.kv_cache_tokens is not None else available_memory_bytes(device, memory)
    )
    budget = settings.kv_cache_memory_fraction * available
    if device.type == "cuda" and settings.kv_cache_tokens is None:
        headroom = headroom_bytes(
            model.config,
            dtype,
            max_batched_tokens=settings.max_batched_tokens,
            max_model_len=max_model_len,
            num_slots=settings.max_batch_size,
        )
        budget = kv_budget_bytes(available, headroom, settings.kv_cache_memory_fraction)
    size = size_kv_cache(
        max_batch_size=settings.max_batch_size,
        max_model_len=max_model_len,
        bytes_per_token=shape.kv_bytes_per_token(dtype),
        budget_bytes=budget,
        kv_cache_tokens=settings.kv_cache_tokens,
    )
    if size.num_slots < settings.max_batch_size:
        logger.warning(
            "the KV budget (%.0f%% of %.1f GiB available) holds %d of %d slots of %d positions;"
            " raise kv_cache_memory_fraction or the memory limit, or lower max_model_len",
            100 * settings.kv_cache_memory_fraction,
            available / 2**30,
            size.num_slots,
            settings.max_batch_size,
            max_model_len,
        )
    runner = ModelRunner(
        model,
        num_slots=size.num_slots,
        max_model_len=max_model_len,
        linear_backend=settings.linear_backend,
        calibration=CalibrationCache(CommonSettings().home / "calibration"),
        quantization=settings.quantization,
        decode_step=decode_step,
        overlap_steps=pick_overlap_steps(settings.overlap_steps, decode_step, device),
        prefill_dtype=settings.prefill_dtype,
    )
    if runner.static is not None:
        logger.info(
            "static decode step (%s, overlapped %s): %d row buckets %s, %d graphs compiled at"
            " load in %.1f s",
            decode_step,
            runner.overlap_steps,
            len(runner.static.row_buckets),
            list(runner.static.row_buckets),
            runner.static.stats.num_compiles,
            runner.static.stats.warm_up_seconds,
        )
    for record in runner.calibrations:
        logger.info(
            "calibrated at load: %s=%s (%s, %.3f s) %s",
            record.name,
            record.choice,
            record.source,
            record.seconds,
            {name: round(value, 3) for name, value in record.figures.items()},
        )
    logger.info(
        "loaded %s on %s/%s in %.1f s (%d calibrations, %.2f s): %d slots x %d positions,"
        " KV budget %d tokens",
        source,
        device,
        dtype,
        time.perf_counter() - load_start,
        len(runner.calibrations),
        sum(record.seconds for record in runner.calibrations),
        size.num_slots,
        max_model_len,
        size.num_tokens,
    )
    return runner, tokenizer, size.num_tokens
