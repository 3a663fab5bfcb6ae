"""Products in int16 (``--prefill-dtype int16``, ``--decode-dtype int16``; what ``auto``
chooses for both on CPUs without bf16 units whose kernels run SIMD int16 products: AVX512_VNNI
(Intel Cascade Lake and Ice Lake, or a newer Xeon whose hypervisor hides AVX512_BF16 and AMX)
or AVX2 (AMD Zen 2 and 3, older Intel): the decoder's fp32 native layers keep an int16 copy of
their weights (:func:`~slotserve.engine.core.kernels.pack_int16`: integers within +-8191 and one
scale a channel), and a step whose products run narrow (a prefill step, a decode step)
multiplies on it (``kernels/int16.c``) with VPDPWSSD or VPMADDWD: the rows scaled to int16 per
64 columns, each group's int32 sums exact, accumulated in fp32. Both give the plain C version's
results to the bit.

Why: there a prefill chunk's fp32 products run at the FMA units' rate and bf16 would be
emulated, while one VPDPWSSD does twice an FMA's multiply-adds at the same rate (a VPMADDWD and
its VPADDD 1.2-1.45x an FMA's on a Zen 3); decode steps stream half the bytes. Measured on a
2-core Xeon of family 6 model 207 (AVX512_VNNI, no AVX512_BF16 or AMX exposed): SmolLM2's
gate/up shape at 1,024 rows 222-300 GFLOPS against the fp32 panels' 152-200; a decode step's 120
products (weights from memory) 13.3 / 16.6 / 27.0 ms at 1 / 8 / 32 rows against 19.6 / 24.3 /
46.3. On a 2-core Zen 3 (AVX2 only), in one engine: decode steps 25.8 / 41.3 / 109.4 ms at
1 / 8 / 32 sequences against fp32's 36.8 / 55.4 / 130.6, prefill 1.09x.

What it costs: an int16 copy of the decoder's weights (half the fp32 bytes; the output
projection stays fp32). Quality: teacher-forced on SmolLM2's shipped text
(``bench/quant_quality.py --engine int16``, fp16 KV cache) 99.87% greedy agreement with fp32,
perplexity +0.00%. A step that scores its prompt (prompt logprobs) runs in fp32: the runner
turns the shared gate off for it. The layers share one gate with bf16's copies, so int16 asked
for on one side turns bf16 off on the other (only an explicit setting can ask for both).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from slotserve.engine.core.kernels import NativeKernels, pack_int16
from slotserve.engine.core.model.bf16_prefill import decoder_linears
from slotserve.engine.core.model.native_linear import Bf16Gate

logger = logging.getLogger(__name__)


def wants_int16(dtype: str, units: list[str], kernels: NativeKernels | None) -> bool:
    """Whether products set to ``dtype`` (a prefill_dtype or decode_dtype) should run in int16:
    asked for, wherever the kernels run SIMD int16 products (:attr:`NativeKernels.int16_products`:
    VPDPWSSD or VPMADDWD); or ``auto`` on a CPU without bf16 ``units`` where they outrun the fp32
    panels beside them: VPDPWSSD, or VPMADDWD where the panels are AVX2's too (an AVX-512 CPU
    without VNNI multiplies fp32 16 lanes wide, faster than VPMADDWD's 8 int32 lanes)."""
    if kernels is None or kernels.int16_products == "plain_c":
        return False
    if dtype == "int16":
        return True
    faster = kernels.int16_products == "avx512_vnni" or kernels.isa == "avx2_fma"
    return dtype == "auto" and not units and faster


@dataclass(frozen=True)
class Int16Plan:
    """Which steps multiply in int16 (:func:`plan_int16`), and the settings that named it."""

    prefill: bool
    decode: bool
    asked: tuple[str, ...]

    def __bool__(self) -> bool:
        return self.prefill or self.decode


def plan_int16(
    prefill_dtype: str,
    decode_dtype: str,
    quantization: str,
    units: list[str],
    kernels: NativeKernels | None,
) -> Int16Plan:
    """Each side that asked for int16, or whose ``auto`` takes it (:func:`wants_int16`, fp32
    weights only; ``units``: the CPU's bf16 units). An explicit int16 is planned even where it
    cannot run: :func:`install_int16` then warns and installs nothing."""
    sides = (("prefill", prefill_dtype), ("decode", decode_dtype))
    taken = [
        dtype == "int16" or (quantization == "none" and wants_int16(dtype, units, kernels))
        for _, dtype in sides
    ]
    asked = tuple(f"{side}_dtype" for side, dtype in sides if dtype == "int16")
    return Int16Plan(prefill=taken[0], decode=taken[1], asked=asked)


def install_int16(model: Any, kernels: NativeKernels | None, plan: Int16Plan) -> Bf16Gate | None:
    """Give the decoder's fp32 native layers their packed int16 weights, sharing a new gate
    (returned), where the kernels run SIMD int16 products; else None. Only the settings that
    named int16 (``plan.asked``) warn when it cannot run."""
    if kernels is None or kernels.int16_products == "plain_c":
        for setting in plan.asked:
            logger.warning(
                "%s int16 needs the native kernels on a CPU with AVX2 or AVX512_VNNI (this "
                "CPU's kernels: %s): those products run in float32",
                setting,
                "none" if kernels is None else kernels.isa,
            )
        return None
    layers = [layer for layer in decoder_linears(model) if layer.weight_fp32 is not None]
    if not layers:
        for setting in plan.asked:
            logger.warning(
                "%s int16 needs the decoder's linear layers on the native kernels (fp32 "
                "weights; linear_backend auto or native, no quantization): those products run "
                "in the layers' own precision",
                setting,
            )
        return None
    gate = Bf16Gate(on=False)
    nbytes = 0
    for layer in layers:
        assert layer.weight_fp32 is not None
        layer.weight_int16, layer.scale_int16 = pack_int16(layer.weight_fp32)
        nbytes += layer.weight_int16.numel() * 2
        layer.bf16_gate = gate
    steps = [side for side, on in (("prefill", plan.prefill), ("decode", plan.decode)) if on]
    code = kernels.int16_products
    logger.info(
        "%s products in int16 on %s (native kernels, %s): %d decoder layers, "
        "%.0f MB of int16 weights",
        " and ".join(steps),
        code,
        "VPDPWSSD" if code == "avx512_vnni" else "VPMADDWD",
        len(layers),
        nbytes / 1e6,
    )
    return gate
