"""Prefill products in int16 (``--prefill-dtype int16``; what ``auto`` chooses on CPUs with
AVX512_VNNI but no bf16 units: Intel Cascade Lake and Ice Lake, or a newer Xeon whose
hypervisor hides AVX512_BF16 and AMX): the decoder's fp32 native layers keep an int16 copy of
their weights (:func:`~slotserve.engine.core.kernels.pack_int16`: integers within +-8191 and
one scale a channel), and a step with a prefill chunk multiplies on it with VPDPWSSD
(``kernels/int16_vnni.c``): the rows scaled to int16 per 64 columns, each group's int32 sums
exact, accumulated in fp32.

Why: there a prefill chunk's fp32 products run at the FMA units' rate and bf16 would be
emulated, while one VPDPWSSD does twice an FMA's multiply-adds at the same rate. Measured on
SmolLM2's gate/up shape at 1,024 rows, 2 threads, on a Xeon of family 6 model 207 (AVX512_VNNI,
no AVX512_BF16 or AMX exposed): 222-300 GFLOPS against the fp32 panels' 152-200.

What it costs: an int16 copy of the decoder's weights (half the fp32 bytes). Quality:
teacher-forced on SmolLM2's shipped text (``bench/quant_quality.py --engine int16``, fp16 KV
cache) 99.87% greedy agreement with fp32, perplexity +0.00% (the same products with their
operands rounded to bf16 instead: 99.3%). Decode-only steps keep fp32 (decode_dtype), and a
step that scores its prompt (prompt logprobs) runs in fp32: the runner turns the shared gate
off for it.
"""

from __future__ import annotations

import logging
from typing import Any

from slotserve.engine.core.kernels import NativeKernels, pack_int16
from slotserve.engine.core.model.bf16_prefill import decoder_linears
from slotserve.engine.core.model.native_linear import Bf16Gate
from slotserve.engine.settings import PrefillDType

logger = logging.getLogger(__name__)


def wants_int16_prefill(
    prefill_dtype: PrefillDType, units: list[str], kernels: NativeKernels | None
) -> bool:
    """Whether prefill should multiply in int16: asked for, or ``auto`` on a CPU without bf16
    ``units`` whose kernels run VPDPWSSD (:attr:`NativeKernels.vnni`); decided before the
    linear layers are chosen (they must be native fp32)."""
    if prefill_dtype == "int16":
        return kernels is not None and kernels.vnni
    return prefill_dtype == "auto" and not units and kernels is not None and kernels.vnni


def install_int16_prefill(
    model: Any, prefill_dtype: PrefillDType, units: list[str], kernels: NativeKernels | None
) -> Bf16Gate | None:
    """Give the decoder's fp32 native layers their int16 prefill weights when
    :func:`wants_int16_prefill`; returns the gate they share, else None. Only an explicit
    ``int16`` that cannot run warns."""
    explicit = prefill_dtype == "int16"
    if not wants_int16_prefill(prefill_dtype, units, kernels):
        if explicit:
            logger.warning(
                "prefill_dtype int16 needs the native kernels on a CPU with AVX512_VNNI (this "
                "CPU's kernels: %s): prefill runs in float32",
                "none" if kernels is None else kernels.isa,
            )
        return None
    layers = [layer for layer in decoder_linears(model) if layer.weight_fp32 is not None]
    if not layers:
        if explicit:
            logger.warning(
                "prefill_dtype int16 needs the decoder's linear layers on the native kernels "
                "(fp32 weights; linear_backend auto or native, no quantization): prefill runs in "
                "the layers' own precision"
            )
        else:
            logger.info("prefill products in float32: the decoder's layers are not native fp32")
        return None
    gate = Bf16Gate(on=False)
    nbytes = 0
    for layer in layers:
        assert layer.weight_fp32 is not None
        layer.weight_int16, layer.scale_int16 = pack_int16(layer.weight_fp32)
        nbytes += layer.weight_int16.numel() * 2
        layer.bf16_gate = gate
    logger.info(
        "prefill products in int16 on avx512_vnni (native kernels, VPDPWSSD): %d decoder "
        "layers, %.0f MB of int16 weights",
        len(layers),
        nbytes / 1e6,
    )
    return gate
