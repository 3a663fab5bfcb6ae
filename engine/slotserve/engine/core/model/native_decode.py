"""Decode steps of Llama-style models in one native call (``kernels/llama_step.c``).

A step whose chunks are all single tokens (the steady state of continuous batching) spends most
of its time outside the products when it runs through the transformers modules: at batch 1 on
2 cores, 60 ms a step in fp32 where the products streamed the weights in 36 ms. The native step
runs every layer in C on the weights the linear setup already prepared (fp32, int8 or int4
:class:`NativeLinear` layers), writes keys and values into the runner's slot cache and returns
the final-normed hidden states; the runner's output layer and sampler take it from there.

Prefill chunks run through the same call (issue 24, item 1): a chunk is one row per token,
every row of a sequence at its own position in the sequence's slot. The C code writes all rows'
keys and values into the cache before any row attends, and row i attends to its slot's cache up
to its own position, so attention within a chunk is causal over the slot's earlier positions (a
previous chunk, a prefix-cache copy) and the chunk's own. Decode rows and prefill chunks mix
freely in one call; every row's final-normed hidden state comes back (the prompt-logprobs hook
reads them as it reads the transformers path's).

Only models whose layers are exactly what the C code computes get it (:func:`native_step`):
Llama, Mistral and Qwen2 decoder layers with SiLU, RMSNorm, fused q/k/v and gate/up on native
layers. Anything else (Qwen3's q/k norms, Gemma's scaled norms, ...) runs through transformers
as before, and so does a decode-only step wider than the native layers' row limit.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from slotserve.engine.core.kernels import CACHE_DTYPES, NativeKernels
from slotserve.engine.core.model.fusion import FusedGatedMLP, QKVPart
from slotserve.engine.core.model.native_linear import Bf16Gate, NativeLinear
from slotserve.engine.core.model.native_rows_watch import STEP_OBSERVER

logger = logging.getLogger(__name__)

PRODUCTS = 4  # q/k/v, o, gate/up, down: the order of struct step_layer's arrays
KINDS = {"float32": 0, "int8": 1, "int4": 2, "bfloat16": 3, "int16": 4}  # enum kind in kernels.h
# Decoder layers and norms whose forward is exactly Llama's (transformers 5.x; Qwen2 adds a
# q/k/v bias, which the native layers carry; sliding windows are refused by the runner).
LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})

_Pointers = ctypes.c_void_p * PRODUCTS
# kernels.h's slotserve_wide_product: (layer, which, x, m, k, y, n) -> 0 or nonzero; x and y
# bf16, m a multiple of 16 (the step pads and converts).
WideProduct = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int64,
)
NEVER = 2**62  # wide_rows that no step reaches: every product native


class StepLayer(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64 * PRODUCTS),
        ("data", _Pointers),
        ("scale", _Pointers),
        ("minimum", _Pointers),
        ("bias", _Pointers),
        ("input_norm", ctypes.c_void_p),
        ("post_attention_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class StepModel(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("max_len", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("final_norm", ctypes.c_void_p),
        ("layers", ctypes.POINTER(StepLayer)),
        ("wide", WideProduct),
        ("wide_rows", ctypes.c_int64),
        ("bf16_attention", ctypes.c_int64),
        ("kv_half", ctypes.c_int64),
        ("bf16_quantized", ctypes.c_int64),
    ]


class NotSupported(Exception):
    """The model is not one the native step computes exactly (the message says why)."""


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None or tensor.numel() == 0 else tensor.data_ptr()


def _fp32(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise NotSupported(f"{what} is not a contiguous float32 CPU tensor")
    return tensor


def _cache(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """A cache layer the C code reads and writes in place: fp32, or fp16 (kv_half.c)."""
    if (
        tensor.dtype not in CACHE_DTYPES
        or not tensor.is_contiguous()
        or tensor.device.type != "cpu"
    ):
        raise NotSupported(f"{what} is not a contiguous fp32 or fp16 CPU tensor")
    return tensor


def _native(module: object, what: str) -> NativeLinear:
    if not isinstance(module, NativeLinear):
        raise NotSupported(f"{what} is {type(module).__name__}, not a native layer")
    return module


def _unsupported_kind(model: Any) -> str | None:
    """Why ``model``'s layers are not of the kinds the native step computes, or None."""
    act = getattr(model.config, "hidden_act", None)
    if act != "silu":
        return f"activation {act!r} is not silu"
    decoder = model.get_decoder()
    for name in ("embed_tokens", "rotary_emb", "norm", "layers"):
        if not hasattr(decoder, name):
            return f"the decoder has no {name}"
    for index, layer in enumerate(decoder.layers):
        if type(layer).__name__ not in LAYER_CLASSES:
            return f"layer {index} is {type(layer).__name__}"
    return None if len(decoder.layers) else "the decoder has no layers"


def step_eligible(model: Any) -> bool:
    """Whether ``model``'s layers are of the kinds the native step computes (before the linear
    setup: whether its linears end up native is decided there)."""
    return _unsupported_kind(model) is None


class NativeDecodeStep:
    """Runs decode-only steps of one model through ``slotserve_llama_step``."""

    def __init__(
        self,
        model: Any,
        kernels: NativeKernels,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> None:
        """Raises :class:`NotSupported` when the model's layers are not what the C code does."""
        config = model.config
        decoder = model.get_decoder()
        reason = _unsupported_kind(model)
        if reason is not None:
            raise NotSupported(reason)
        self.kernels = kernels
        # Decode-step timings for the calibration's steady-state check, if one is attached.
        self.observe: Callable[[int, float], None] | None = getattr(decoder, STEP_OBSERVER, None)
        self.embed: nn.Module = decoder.embed_tokens
        self.rotary: nn.Module = decoder.rotary_emb
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        norms: list[Any] = [decoder.norm]  # transformers' RMSNorm classes, not typed here
        layers = (StepLayer * len(decoder.layers))()
        self._linears: list[NativeLinear] = []
        scales = set()
        for index, layer in enumerate(decoder.layers):
            attention, mlp = layer.self_attn, layer.mlp
            if not isinstance(attention.q_proj, QKVPart) or not isinstance(mlp, FusedGatedMLP):
                raise NotSupported("q/k/v or gate/up are not fused")
            linears = [
                _native(attention.q_proj.shared.linear, "q/k/v"),
                _native(attention.o_proj, "o_proj"),
                _native(mlp.gate_up_proj, "gate/up"),
                _native(mlp.down_proj, "down_proj"),
            ]
            entry = layers[index]
            self._linears += linears
            for slot, linear in enumerate(linears):
                entry.kind[slot] = KINDS[linear.format]
                weight = linear.weight_fp32 if linear.format == "float32" else linear.q
                entry.data[slot] = _pointer(weight)
                entry.scale[slot] = _pointer(linear.scale)
                entry.minimum[slot] = _pointer(linear.minimum)
                entry.bias[slot] = _pointer(linear.bias)
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            entry.input_norm = _fp32(layer.input_layernorm.weight, "a norm weight").data_ptr()
            entry.post_attention_norm = _fp32(
                layer.post_attention_layernorm.weight, "a norm weight"
            ).data_ptr()
            entry.k_cache = _cache(k_cache[index], "the key cache").data_ptr()
            entry.v_cache = _cache(v_cache[index], "the value cache").data_ptr()
            scales.add(float(attention.scaling))
        if {type(norm).__name__ for norm in norms} - NORM_CLASSES:
            raise NotSupported("a norm is not an RMSNorm")
        epsilons = {float(norm.variance_epsilon) for norm in norms}
        if len(epsilons) != 1 or len(scales) != 1:
            raise NotSupported("layers differ in their norm epsilon or attention scale")
        self.struct = StepModel(
            num_layers=len(decoder.layers),
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=config.intermediate_size,
            max_len=k_cache[0].shape[2],
            eps=epsilons.pop(),
            scale=scales.pop(),
            final_norm=_fp32(decoder.norm.weight, "the final norm weight").data_ptr(),
            layers=layers,
            kv_half=int(k_cache[0].dtype == torch.float16),
        )
        self._layers = layers  # the struct points into it
        # The same layers on the packed bf16 weights (use_packed_bf16) or the packed int16 ones
        # (use_packed_int16), for steps with the gate on; None: every step multiplies the
        # layers' own weights.
        self._layers_gated: Any = None
        self.struct.wide_rows = NEVER
        # bf16 prefill products (use_bf16_products): the layers' bf16 weights, the gate that
        # turns them off for a step, the callback the C code calls and what it raised.
        self._bf16: list[torch.Tensor] = []
        self._gate: Bf16Gate | None = None
        self._wide: Any = None
        self._wide_error: BaseException | None = None
        self.wide_products = 0  # bf16 products run through the callback (tests, benchmarks)
        self.bf16_products = False  # use_bf16_products' switch (benchmarks turn it off)
        self.quantized_bf16 = False  # use_quantized_bf16's switch
        self.int16 = False  # use_packed_int16's: the gated layers are int16, attention stays fp32
        # Steps with prefill chunks run here too (False: through transformers, as before).
        self.prefill = True
        # The cache rows the C code writes: [slots, kv_heads, max_len, head_dim] per layer.
        self.num_slots = k_cache[0].shape[0]
        if tuple(k_cache[0].shape[1:]) != (kv_heads, self.struct.max_len, head_dim):
            raise NotSupported("the cache is not laid out [slots, kv_heads, max_len, head_dim]")

    def use_bf16_products(self, gate: Bf16Gate) -> bool:
        """Run products of :attr:`onednn_rows` rows or more (prefill chunks; on AMX CPUs wide
        decode steps too) as bf16 GEMMs through torch's oneDNN on the layers' bf16 weights
        (``bf16_prefill.py``), while ``gate`` is on; the rest of the step stays in C. False if
        a layer has no bf16 weights."""
        weights = [linear.weight_bf16 for linear in self._linears]
        if any(weight is None for weight in weights):
            return False
        self._bf16 = [weight for weight in weights if weight is not None]
        self._gate = gate
        self._wide = WideProduct(self._wide_product)  # kept: the struct holds only its address
        self.struct.wide = self._wide
        self.bf16_products = True
        return True

    def use_packed_bf16(self, gate: Bf16Gate) -> bool:
        """Multiply on the layers' packed bf16 weights with the native bf16 kernels while
        ``gate`` is on (every product the step computes itself: with :meth:`use_bf16_products`
        too, those below its wide rows). False if a layer has no packed weights."""
        if any(linear.weight_packed is None for linear in self._linears):
            return False
        layers = self._layers_copy()
        for index in range(len(self._layers)):
            for slot in range(PRODUCTS):
                weight = self._linears[index * PRODUCTS + slot].weight_packed
                assert weight is not None
                layers[index].kind[slot] = KINDS["bfloat16"]
                layers[index].data[slot] = weight.data_ptr()
                layers[index].scale[slot] = layers[index].minimum[slot] = None
        self._layers_gated = layers
        self._gate = gate
        return True

    def use_packed_int16(self, gate: Bf16Gate) -> bool:
        """Multiply on the layers' packed int16 weights (``kernels/int16.c``) while
        ``gate`` is on: every product of the step. False if a layer has no int16 weights."""
        if any(linear.weight_int16 is None for linear in self._linears):
            return False
        layers = self._layers_copy()
        for index in range(len(self._layers)):
            for slot in range(PRODUCTS):
                linear = self._linears[index * PRODUCTS + slot]
                assert linear.weight_int16 is not None and linear.scale_int16 is not None
                layers[index].kind[slot] = KINDS["int16"]
                layers[index].data[slot] = linear.weight_int16.data_ptr()
                layers[index].scale[slot] = linear.scale_int16.data_ptr()
                layers[index].minimum[slot] = None
        self._layers_gated = layers
        self._gate = gate
        self.int16 = True
        return True

    def _layers_copy(self) -> Any:
        """A copy of the layers (the norms, caches and biases stay fp32's), for a gated route
        to point at other weights."""
        layers = (StepLayer * len(self._layers))()
        for index, entry in enumerate(self._layers):
            ctypes.memmove(ctypes.byref(layers[index]), ctypes.byref(entry), ctypes.sizeof(entry))
        return layers

    def use_quantized_bf16(self, gate: Bf16Gate) -> bool:
        """Multiply int8/int4 weights with their rows in bf16 while ``gate`` is on (prefill
        chunks of a quantized model, ``kernels/quantized_bf16.c``): the weights widened to bf16
        a few channels at a time, no bf16 copy kept. False unless every layer is quantized and
        the kernels run AVX512_BF16."""
        if self.kernels.isa != "avx512_bf16" or any(
            linear.format not in ("int8", "int4") for linear in self._linears
        ):
            return False
        self._gate = gate
        self.quantized_bf16 = True
        return True

    def _wide_product(self, layer: int, which: int, x: int, m: int, k: int, y: int, n: int) -> int:
        # Called from inside slotserve_llama_step (ctypes takes the GIL back for it).
        try:
            weight = self._bf16[layer * PRODUCTS + which]
            rows, out = self._halves(x, m * k), self._halves(y, m * n)
            torch.mm(rows.view(m, k), weight.t(), out=out.view(m, n))  # oneDNN, as F.linear
            self.wide_products += 1
            return 0
        except BaseException as error:  # an exception must not unwind through the C frames
            self._wide_error = error
            return 1

    def _halves(self, address: int, count: int) -> torch.Tensor:
        """``count`` bf16 values at ``address``: a view of the workspace's tensor, where the
        step's buffers come from once it has grown (a slice; a ctypes array type per call cost
        more than the product at small shapes), else of the memory itself."""
        block = self.kernels.workspace.buffer
        if block is not None:
            offset = address - block.data_ptr()
            if offset >= 0 and offset % 2 == 0 and offset + 2 * count <= block.numel():
                return block[offset : offset + 2 * count].view(torch.bfloat16)
        memory = (ctypes.c_uint16 * count).from_address(address)
        return torch.frombuffer(memory, dtype=torch.bfloat16)

    @property
    def max_rows(self) -> int:
        """The widest step run natively: the native layers' row limit (which a re-taken
        calibration may change while the engine runs)."""
        return min(linear.max_native_rows for linear in self._linears)

    @property
    def onednn_rows(self) -> int:
        """The fewest rows whose bf16 products go to oneDNN (:meth:`use_bf16_products`)."""
        return min(linear.onednn_rows() for linear in self._linears)

    def takes(self, num_tokens: list[int]) -> bool:
        """Whether a step of chunks of these sizes runs here: a decode-only step up to
        :attr:`max_rows` rows (wider ones are faster on aten's products), any step with a
        prefill chunk when :attr:`prefill` is on (its products are compute-bound: the native
        panels, AVX-512 where present, against the transformers path's fp32 GEMMs plus its
        per-op work)."""
        if all(n == 1 for n in num_tokens):
            return len(num_tokens) <= self.max_rows
        return self.prefill

    def __call__(
        self, token_ids: list[int], positions: list[int], slots: list[int]
    ) -> torch.Tensor:
        """The final-normed hidden states [rows, hidden] of one token per row, each at its
        position in its slot's cache row (positions below max_len, no (slot, position) twice).
        Rows of one slot are a prefill chunk: each attends to the positions before its own,
        those of earlier steps and of this one's rows alike."""
        if not (0 <= min(slots) <= max(slots) < self.num_slots) or not (
            0 <= min(positions) <= max(positions) < self.struct.max_len
        ):
            raise ValueError("a slot or position outside the cache")
        decode = len(set(slots)) == len(slots)
        if not decode and len(set(zip(slots, positions, strict=True))) != len(slots):
            raise ValueError("two rows of one step at the same slot and position")
        started = time.perf_counter()
        if self._gate is not None:
            on = self._gate.on
            self.struct.wide_rows = self.onednn_rows if on and self.bf16_products else NEVER
            packed = on and self._layers_gated is not None
            self.struct.layers = self._layers_gated if packed else self._layers
            # The C code runs bf16 attention where the CPU can, beside bf16 products only.
            self.struct.bf16_attention = int(on and not self.int16)
            self.struct.bf16_quantized = int(on and self.quantized_bf16)
        ids = torch.tensor(token_ids)
        positions_t = torch.tensor(positions)
        hidden = self.embed(ids).contiguous()  # a fresh tensor: the step overwrites it
        cos, sin = self.rotary(hidden.unsqueeze(0), positions_t.unsqueeze(0))
        try:
            self.kernels.llama_step(
                self.struct,
                hidden,
                cos[0].contiguous(),
                sin[0].contiguous(),
                torch.tensor(slots),
                positions_t,
            )
        except MemoryError:
            error, self._wide_error = self._wide_error, None
            if error is not None:  # the step failed in a bf16 product, not for memory
                raise error from None
            raise
        if self.observe is not None and decode:  # the watch compares decode steps only
            self.observe(len(token_ids), time.perf_counter() - started)
        return hidden


def native_step(
    model: Any,
    kernels: NativeKernels | None,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
) -> NativeDecodeStep | None:
    """The native decode step for ``model`` if it can run one exactly, else None (logged)."""
    if kernels is None:
        return None
    try:
        step = NativeDecodeStep(model, kernels, k_cache, v_cache)
    except NotSupported as reason:
        logger.info("decode steps run through transformers: %s", reason)
        return None
    logger.info("decode steps of up to %d rows run natively in one call", step.max_rows)
    return step
