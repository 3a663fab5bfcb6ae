"""Prefill products in bfloat16 (``--prefill-dtype``, ``auto`` by default: bfloat16 wherever the
CPU has bf16 units and the layers are native fp32): the decoder's fp32 native layers keep a
bf16 copy of their weights, and a step with a prefill chunk multiplies on it, accumulating in
fp32. Wherever the native kernels run AVX512_BF16 every product runs on their packed bf16
weights, fp32 out: on the AMX tiles from 16 rows where the CPU has AMX (``kernels/gemm_amx.c``,
as fast as oneDNN's GEMM there), VDPBF16PS otherwise (``kernels/bf16_avx512.c``, faster than
oneDNN's on a Zen 4). Only where the kernels cannot multiply bf16 do products of 16 rows or more
(:data:`AMX_ROWS`) run as one bf16 GEMM through torch (oneDNN), whose bf16 results cost
quality. Decode-only steps follow ``--decode-dtype`` (bf16_decode.py). An int8 or int4 model
keeps no bf16 copy: where the kernels run AVX512_BF16 its prefill products widen the weights to
bf16 a few channels at a time as they multiply (``kernels/quantized_bf16.c``).

Why: serving with prompts is prefill-bound, and a prefill chunk's products are compute-bound.
Where the CPU has bf16 dot-product units, oneDNN's bf16 GEMM does several times the fp32 work
per cycle: measured on SmolLM2's seven decoder products at 512 rows, 2 threads, 18.5 ms native
fp32, 11.3 ms aten fp32, 3.0 ms aten bf16 on an Intel Xeon with AMX-BF16; 2.3x fp32 on an AMD
Zen 4 (AVX512_BF16, no AMX). Without those units torch emulates bf16 (slower than fp32), so the
setting is refused with one warning there and prefill stays fp32.

What it costs: a bf16 copy of the decoder's weights (half the fp32 bytes), and prefill's
activations rounded to bf16 before each product (what vLLM's CPU backend does to every
product). Its quality against fp32 is measured by ``bench/quant_quality.py --prefill-dtype
bfloat16`` (docs/engine.md has the figures). The output projection stays fp32: logits are
computed at the sampled positions only. A step that scores a prompt (prompt logprobs: lm-eval's
loglikelihoods, which must equal fp32's to 1e-3 a token) runs in fp32: the runner turns the
layers' shared :class:`Bf16Gate` off for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from slotserve.engine.core.kernels import NativeKernels, pack_bf16
from slotserve.engine.core.model.calibration import cpu_identity
from slotserve.engine.core.model.fusion import QKVPart
from slotserve.engine.core.model.native_linear import Bf16Gate, NativeLinear
from slotserve.engine.settings import PrefillDType

logger = logging.getLogger(__name__)

# /proc/cpuinfo flags of the units oneDNN's bf16 GEMM runs on (AMX tiles or AVX-512 BF16).
BF16_UNITS = ("amx_bf16", "avx512_bf16")
# On AMX CPUs, bf16 products of this many rows or more go to oneDNN, decode steps' included: a
# tile holds 16 rows. SmolLM2's seven decoder products x 30 layers, 2 threads, on an Intel Xeon
# with AMX: packed kernels / oneDNN 0.65x at 8 rows, 1.06x at 16, 1.48x at 32, 1.87x at 64.
AMX_ROWS = 16


def bf16_units(identity: Mapping[str, str] | None = None) -> list[str]:
    """Which of :data:`BF16_UNITS` this CPU has (empty: bf16 would be emulated)."""
    flags = set((identity or cpu_identity()).get("cpu_flags", "").split())
    return [unit for unit in BF16_UNITS if unit in flags]


def decoder_linears(model: Any) -> list[NativeLinear]:
    """The decoder's native layers, the fused q/k/v products included (their shared layer is
    not a submodule: see fusion.QKVPart)."""
    found: dict[int, NativeLinear] = {}
    for module in model.get_decoder().modules():
        linear = module.shared.linear if isinstance(module, QKVPart) else module
        if isinstance(linear, NativeLinear):
            found.setdefault(id(linear), linear)
    return list(found.values())


def quantized_format(model: Any) -> str | None:
    """``int8`` or ``int4`` when every decoder linear of ``model`` is native and quantized to it
    (their products can take bf16 rows: ``kernels/quantized_bf16.c``), else None."""
    formats = {layer.format for layer in decoder_linears(model)}
    return formats.pop() if formats in ({"int8"}, {"int4"}) else None


def wants_bf16_prefill(prefill_dtype: PrefillDType, quantization: str, units: list[str]) -> bool:
    """Whether the linear setup should keep native fp32 layers for bf16 prefill (asked for or
    auto, fp32 weights, a CPU with bf16 ``units``): decided before the layers are chosen."""
    return prefill_dtype != "float32" and quantization == "none" and bool(units)


def packed_route(units: list[str], kernels: NativeKernels | None) -> bool:
    """Whether prefill's bf16 products run on the native kernels (packed weights: AMX tiles from
    16 rows where the CPU has them, ``kernels/gemm_amx.c``, else VDPBF16PS) rather than oneDNN:
    wherever the kernels run AVX512_BF16. oneDNN through torch writes bf16 results, which cost
    the bf16 path its quality (97.4% greedy agreement with fp32 on an AMX Xeon against 99.2%
    with the kernels' fp32 results), so it is left to kernels that cannot multiply bf16."""
    return bool(units) and kernels is not None and kernels.isa == "avx512_bf16"


def install_bf16_prefill(
    model: Any,
    prefill_dtype: PrefillDType,
    units: list[str],
    kernels: NativeKernels | None,
    *,
    native_step: bool = False,
) -> Bf16Gate | None:
    """Give the decoder's fp32 native layers their bf16 prefill weights when asked (``auto``:
    wherever it can run) and the CPU has bf16 ``units`` (:func:`bf16_units`): packed for the
    native kernels or plain for oneDNN (:func:`packed_route`). int8/int4 layers get no copy:
    where the kernels run AVX512_BF16 and the model's prefill runs in the native step
    (``native_step``), that step widens their weights as it multiplies. Returns the gate they
    share, else None. Only an explicit ``bfloat16`` that cannot run warns."""
    if prefill_dtype == "float32":
        return None
    explicit = prefill_dtype == "bfloat16"
    if not units:
        if not explicit:
            logger.info("prefill products in float32: no bf16 units on this CPU")
            return None
        logger.warning(
            "prefill_dtype bfloat16 needs a CPU with AMX-BF16 or AVX512_BF16 (bf16 would be "
            "emulated, slower than fp32): prefill runs in float32"
        )
        return None
    quantized = quantized_format(model)
    if quantized and native_step and packed_route(units, kernels):
        # int8/int4 layers keep no bf16 copy: the native step widens their weights to bf16 a
        # few channels at a time as it multiplies (kernels/quantized_bf16.c).
        logger.info(
            "prefill products in bfloat16 on %s (native kernels, VDPBF16PS): the decoder's %s "
            "weights widened to bf16 as they are multiplied, no copy kept",
            "+".join(units),
            quantized,
        )
        return Bf16Gate(on=False)
    layers = [layer for layer in decoder_linears(model) if layer.weight_fp32 is not None]
    if not layers:
        if not explicit:
            logger.info("prefill products in float32: the decoder's layers are not native fp32")
            return None
        logger.warning(
            "prefill_dtype bfloat16 needs the decoder's linear layers on the native kernels "
            "(fp32 weights, or int8/int4 where they run AVX512_BF16; linear_backend auto or "
            "native): prefill runs in the layers' own precision"
        )
        return None
    gate = Bf16Gate(on=False)
    packed = packed_route(units, kernels)
    nbytes = 0
    for layer in layers:
        assert layer.weight_fp32 is not None
        if packed:
            layer.weight_packed = pack_bf16(layer.weight_fp32)
            nbytes += layer.weight_packed.numel() * 2
        else:
            layer.weight_bf16 = layer.weight_fp32.to(torch.bfloat16)
            nbytes += layer.weight_bf16.numel() * 2
            if "amx_bf16" in units:
                layer.amx_rows = AMX_ROWS
        layer.bf16_gate = gate
    if not packed:
        route = f"oneDNN from {layers[0].onednn_rows()} rows"
    elif kernels is not None and kernels.amx:
        route = "native kernels, AMX tiles from 16 rows"
    else:
        route = "native kernels, VDPBF16PS"
    logger.info(
        "prefill products in bfloat16 on %s (%s): %d decoder layers, %.0f MB of bf16 weights",
        "+".join(units),
        route,
        len(layers),
        nbytes / 1e6,
    )
    return gate
