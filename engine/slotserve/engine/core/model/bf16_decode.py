"""Decode products in bfloat16 (``--decode-dtype``, ``auto`` by default: bfloat16 wherever the
native kernels run AVX512_BF16 and the layers are native fp32): every product the native
kernels take (decode rows, small chunks) and the output projection run on bf16 copies of the
weights, multiplied by VDPBF16PS with fp32 accumulation (``kernels/bf16_avx512.c``).

Why: at 8-32 concurrent requests a CPU engine spends about half its time in decode steps, and
a decode step streams every weight and multiplies it by every row. bf16 halves the bytes and
one VDPBF16PS does twice the multiply-adds of an fp32 FMA: measured on a 2-core EPYC Zen 4,
SmolLM2's gate/up products of 30 layers (weights streamed from memory, best of 9) took 4.4 / 4.8
/ 14.5 ms at 1 / 8 / 32 rows on the packed bf16 weights against 8.5 / 9.5 / 26.2 ms native fp32
and 10.1 / 10.8 / 15.0 ms through oneDNN in bf16. Where
the CPU lacks the instruction the kernels would widen bf16 to fp32 (slower than fp32 itself),
so ``auto`` stays fp32 there and an explicit ``bfloat16`` warns once and stays fp32. On a CPU
with AMX the kernels multiply products of 16 rows or more on the tiles (``kernels/gemm_amx.c``,
the same packed weights, fp32 results), decode steps' included: there VDPBF16PS had trailed
oneDNN's tiles above 16 rows (1.48x its time at 32) and the tiles match oneDNN.

What it costs: a packed bf16 copy of the decoder's weights (shared with bf16 prefill when both
are on) and of the output projection, and the rows
rounded to bf16 before each product, as bf16 prefill does; its quality against fp32 is measured
by ``bench/quant_quality.py`` (docs/engine.md has the figures). Steps that score a prompt
(prompt logprobs) run in fp32: the runner turns the shared :class:`Bf16Gate` off for them.

Up to how many rows the native kernels take is not measured against aten here, as fp32's is
(``native_linear.measure_native_rows``): bf16 products beat aten's fp32 ones structurally (half
the bytes, twice the multiply-adds), so the CPU-feature rule sets it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from slotserve.engine.core.kernels import NativeKernels, pack_bf16
from slotserve.engine.core.model.bf16_prefill import decoder_linears, quantized_format
from slotserve.engine.core.model.native_linear import Bf16Gate, NativeLinear
from slotserve.engine.settings import DecodeDType

logger = logging.getLogger(__name__)

ISA = "avx512_bf16"  # the kernels' instruction set that multiplies bf16 natively


def wants_bf16_decode(
    decode_dtype: DecodeDType, quantization: str, kernels: NativeKernels | None
) -> bool:
    """Whether decode products run in bf16: asked for (or auto) and native kernels running
    AVX512_BF16 (fp32 weights: on bf16 copies; int8/int4: widened as they are multiplied, in
    steps of 12 rows or more). Only an explicit ``bfloat16`` that cannot run warns."""
    if decode_dtype == "float32":
        return False
    if kernels is not None and kernels.isa == ISA:
        return True
    if decode_dtype == "bfloat16":
        logger.warning(
            "decode_dtype bfloat16 needs the native kernels on a CPU with AVX512_BF16 (this "
            "CPU's kernels: %s): decode runs in the layers' own precision",
            "none" if kernels is None else kernels.isa,
        )
    return False


def install_bf16_decode(
    model: Any,
    logits: Callable[[torch.Tensor], torch.Tensor],
    gate: Bf16Gate | None,
    *,
    native_step: bool = False,
) -> Bf16Gate | None:
    """Give the decoder's fp32 native layers (and the output projection, when native) their
    packed bf16 weights (:func:`~slotserve.engine.core.kernels.pack_bf16`), sharing ``gate`` (a
    new one if None); returns the gate, or None when no layer is native fp32 (the kernels are
    then not in use). int8/int4 layers get no copy: where decode runs in the native step
    (``native_step``), its steps of 12 rows or more widen their weights as they multiply
    (``kernels/quantized_bf16.c``); the output projection stays int8."""
    quantized = quantized_format(model)
    if quantized and native_step:
        logger.info(
            "decode products in bfloat16 in steps of 12 rows or more (VDPBF16PS on the "
            "decoder's %s weights widened as they are multiplied; fewer rows stream them in fp32)",
            quantized,
        )
        return gate or Bf16Gate(on=False)
    layers = [layer for layer in decoder_linears(model) if layer.weight_fp32 is not None]
    if not layers:
        logger.info("decode products in float32: the decoder's layers are not native fp32")
        return None
    gate = gate or Bf16Gate(on=False)
    nbytes = 0
    if isinstance(logits, NativeLinear) and logits.weight_fp32 is not None:
        layers.append(logits)
        # Where bf16 prefill gave the decoder's layers oneDNN's AMX route, the output
        # projection takes it too from the same row count (at 32 rows, 1.5x the packed speed).
        amx_rows = layers[0].amx_rows
        if amx_rows is not None and logits.weight_bf16 is None:
            logits.weight_bf16 = logits.weight_fp32.to(torch.bfloat16)
            logits.amx_rows = amx_rows
            nbytes += logits.weight_bf16.numel() * 2
    for layer in layers:
        assert layer.weight_fp32 is not None
        if layer.weight_packed is None:
            layer.weight_packed = pack_bf16(layer.weight_fp32)
            nbytes += layer.weight_packed.numel() * 2
        layer.bf16_gate = gate
    logger.info(
        "decode products in bfloat16 (%s): %d layers, %.0f MB of bf16 weights added",
        "VDPBF16PS, AMX tiles from 16 rows" if layers[0].kernels.amx else "VDPBF16PS",
        len(layers),
        nbytes / 1e6,
    )
    return gate
