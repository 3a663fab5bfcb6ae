"""Weight-only quantization of a model's linear layers, run by the native kernels.

Both formats work in groups of 32 weights along the input. ``int8``: one scale a group
(``w = scale * q``, q in -127..127), 1.125 bytes a weight: llama.cpp's Q8_0. ``int4``: a scale and
a minimum a group (``w = scale * q + minimum``, q in 0..15), 0.75 bytes a weight: Q4_1. Groups,
not one scale per output channel: on SmolLM2 a per-channel int8 output projection alone moved
the top-1 token at 3.9% of positions, the grouped one at none. The bundled SmolLM2 is itself
a dequantized GGUF (Q4_1 layers, Q8_0 embedding), so int4 rebuilds its layers from their own
grid. The output projection (tied to the input embedding in SmolLM2) is int8 in both modes,
since 4 bits there cost agreement (0.89 top-1 measured), and the embedding itself stays fp32 (a
lookup reads one row per token).

Activations stay fp32: the kernels dequantize weights into registers, never round the inputs.
With few rows (decode) the product streams the packed weights once; with many (prefill), where
a tuned fp32 GEMM is faster, the weight is dequantized for that call and multiplied by torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.kernels import GROUP_SIZE, NativeKernels
from slotserve.engine.core.model.fusion import replace_linears
from slotserve.engine.core.model.native_linear import NativeLinear

logger = logging.getLogger(__name__)


class QuantizationUnsupported(UnsupportedSettingError):
    """This model, dtype or device cannot run the asked quantization (a start-up error)."""


@dataclass(frozen=True)
class QuantizationReport:
    mode: str
    num_layers: int
    bytes_before: int
    bytes_after: int
    seconds: float


def native_layers(model: nn.Module) -> list[NativeLinear]:
    """Every :class:`NativeLinear` of ``model``, those shared by fused q/k/v parts included
    (they hang off a plain object, outside the module tree)."""
    found: dict[int, NativeLinear] = {}
    for module in model.modules():
        linear = getattr(getattr(module, "shared", None), "linear", module)
        if isinstance(linear, NativeLinear):
            found[id(linear)] = linear
    return list(found.values())


def check_device(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise :class:`QuantizationUnsupported` unless ``mode`` can run on ``device`` from
    ``dtype`` weights (a CPU, float32)."""
    if device.type != "cpu":
        raise QuantizationUnsupported(
            f"quantization {mode} runs on CPU only (native kernels); this engine is on "
            f"{device.type}: use --quantization none there"
        )
    if dtype != torch.float32:
        raise QuantizationUnsupported(
            f"quantization {mode} quantizes from float32 weights; got --dtype {str(dtype)[6:]} "
            "(use auto or float32)"
        )


def check_quantizable(model: nn.Module, mode: str) -> None:
    """Raise :class:`QuantizationUnsupported` if ``model`` cannot run ``mode`` here."""
    param = next(model.parameters())
    check_device(mode, param.device, param.dtype)
    decoder = model.get_decoder()  # type: ignore[operator]
    linears = [m for m in decoder.modules() if type(m) is nn.Linear]
    if not linears:
        raise QuantizationUnsupported(
            f"quantization {mode}: {type(model).__name__} has no plain linear layers to quantize"
        )
    odd = sorted({m.in_features for m in linears if m.in_features % GROUP_SIZE})
    if odd:
        raise QuantizationUnsupported(
            f"quantization {mode} needs layer input widths that are multiples of {GROUP_SIZE}; "
            f"{type(model).__name__} has {odd}"
        )


def quantize_model(
    model: nn.Module, mode: Literal["int8", "int4"], kernels: NativeKernels
) -> QuantizationReport:
    """Replace the decoder's linear layers with quantized :class:`NativeLinear` ones, and the
    output projection with an int8 one, in place (the input embedding stays as it is, even
    when the two were tied)."""
    start = time.perf_counter()
    check_quantizable(model, mode)
    decoder = model.get_decoder()  # type: ignore[operator]
    linears = [m for m in decoder.modules() if type(m) is nn.Linear]
    lm_head = model.get_output_embeddings()  # type: ignore[operator]
    if type(lm_head) is nn.Linear:
        linears.append(lm_head)
    before = sum(m.weight.numel() * m.weight.element_size() for m in linears)

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return NativeLinear(kernels, weight, bias, mode)

    replace_linears(decoder, make)
    if type(lm_head) is nn.Linear:
        model.set_output_embeddings(  # type: ignore[operator]
            NativeLinear(kernels, lm_head.weight, lm_head.bias, "int8")
        )
    layers = native_layers(model)
    report = QuantizationReport(
        mode=mode,
        num_layers=len(layers),
        bytes_before=before,
        bytes_after=sum(m.nbytes() for m in layers),
        seconds=time.perf_counter() - start,
    )
    logger.info(
        "quantized %d linear layers to %s (output projection int8): %.0f MB -> %.0f MB in %.1f s",
        report.num_layers,
        mode,
        report.bytes_before / 1e6,
        report.bytes_after / 1e6,
        report.seconds,
    )
    return report
