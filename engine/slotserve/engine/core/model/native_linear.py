"""Linear layers on the native kernels: fp32 for decode on CPU, and the quantized formats.

A decode step multiplies a few rows (one per running sequence) by every weight: its time is
the time to stream the weights. MKL reached 5.6 GB/s on the 49152x576 output projection of the
AVX2 machines we target, where the native kernel streams at the memory's speed. With many rows
(prefill) a tuned GEMM wins, so a native layer hands products above ``max_native_rows`` rows to
torch: the fp32 weight itself, or a quantized one dequantized for that call.

For fp32 the crossover is measured at load (:func:`measure_native_rows`: native against aten at
1, 2, 4, ... rows, interleaved, on the model's first layers, enough to overflow the caches) and
cached per CPU kind like the other calibrations; 0 rows means the native products never won
here and the stock layers stay.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.engine.core.kernels import NativeKernels
from slotserve.engine.core.model.calibration import (
    CalibrationCache,
    CalibrationRecord,
    Measurement,
    Rule,
    RunQueueWait,
)
from slotserve.engine.core.model.fusion import QKVPart, replace_linears
from slotserve.engine.core.model.linear import first_layer_linears, interleaved_timings

logger = logging.getLogger(__name__)

WeightFormat = Literal["float32", "int8", "int4"]
# Quantized layers: up to this many rows a product streams the packed weights; above, it
# dequantizes and calls torch. Decode steps have one row per running sequence.
QUANTIZED_MAX_ROWS = 64
# The fp32 crossover is searched over these row counts (up to the widest decode step).
ROW_STEPS = (1, 2, 4, 8, 16, 32, 64)
# Native must be this much faster at a row count to take it (the stock path is the default).
NATIVE_MARGIN = 0.95
# Where decode steps run as one native call (model/native_decode.py), native products may be up
# to this much slower than aten's and the step still wins: it drops the per-op work around them.
# Measured on a 2-core EPYC (SmolLM2 fp32): the native step took 22 / 38 / 67 ms at 8 / 16 / 32
# rows where the transformers path took 29 / 47 / 76 ms on native products and 104 ms on aten's
# at 32 rows, which the products-only calibration had preferred there.
NATIVE_STEP_MARGIN = 1.10
CALIBRATION_ROUNDS = 5


@dataclass
class Bf16Gate:
    """Shared by the layers of one model that hold bf16 weights: whether this step's products
    use them (the runner sets it per step from the step's kind: prefill_dtype for a step with
    a prefill chunk, decode_dtype for the others, fp32 for one that scores its prompt)."""

    on: bool = True


# oneDNN builds (JIT-compiles) a kernel for each product shape it meets and keeps 1,024: steps of
# every row count up to ~2,000 would rebuild them step after step (~1 ms a shape at 40 rows,
# ~4 at 400, on an AMX Xeon). Rows padded to a multiple of 16 (an AMX tile) keep ~130 shapes a
# product: 150 steps of SmolLM2's four product shapes at 33-700 rows, new shapes 2.7-4.4 s
# unpadded, 1.8-2.0 s padded.
ONEDNN_ROW_BUCKET = 16


def onednn_bf16(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows`` [m, k] (fp32) rounded to bf16 times the bf16 ``weight`` [n, k] through torch's
    oneDNN, [m, n] in bf16, the rows padded to :data:`ONEDNN_ROW_BUCKET` for the GEMM."""
    m = rows.shape[0]
    padded = -(-m // ONEDNN_ROW_BUCKET) * ONEDNN_ROW_BUCKET
    if padded == m:
        return F.linear(rows.to(torch.bfloat16), weight)
    x = torch.empty(padded, rows.shape[1], dtype=torch.bfloat16)
    x[:m] = rows
    x[m:].zero_()  # only the padding: the rows are written once, by the rounding copy
    return F.linear(x, weight)[:m]


class NativeLinear(nn.Module):
    """``y = x @ W.T + b`` through the native kernels, ``W`` in fp32, int8 or int4."""

    def __init__(
        self,
        kernels: NativeKernels,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fmt: WeightFormat,
        max_native_rows: int = QUANTIZED_MAX_ROWS,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.format: WeightFormat = fmt
        self.max_native_rows = max_native_rows
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters: nothing trains or saves these. An fp32 weight that
        # is already contiguous fp32 is shared, not copied (a tied output layer stays one
        # tensor with the embedding).
        self.weight_fp32: torch.Tensor | None = None
        # bf16 copies of the weight, used while the gate is on: products of more rows than the
        # native kernels take run on the plain one through oneDNN where it is set (CPUs with
        # AMX: bf16_prefill.py), any other product on the packed one through the native bf16
        # kernels (kernels.pack_bf16; bf16_prefill.py, bf16_decode.py).
        self.weight_bf16: torch.Tensor | None = None
        self.weight_packed: torch.Tensor | None = None
        # An int16 copy and its channel scales (kernels.pack_int16; int16_products.py), used
        # while the gate is on where the kernels run VPDPWSSD.
        self.weight_int16: torch.Tensor | None = None
        self.scale_int16: torch.Tensor | None = None
        # Where the CPU has AMX (bf16_prefill.py): bf16 products of this many rows or more run
        # on the plain copy through oneDNN even below the native row limit; an AMX tile holds
        # 16 rows, and from there oneDNN's tiles beat the packed kernels (docs/engine.md).
        self.amx_rows: int | None = None
        self.bf16_gate = Bf16Gate(on=False)
        self.q = self.scale = self.minimum = torch.empty(0)
        if fmt == "float32":
            self.weight_fp32 = weight.detach().float().contiguous()
        elif fmt == "int8":
            self.q, self.scale = kernels.quantize_q8(weight)
        else:
            self.q, self.scale, self.minimum = kernels.quantize_q4(weight)
        self.bias = None if bias is None else bias.detach().float()

    def nbytes(self) -> int:
        tensors = [
            t
            for t in (
                self.weight_fp32,
                self.weight_bf16,
                self.weight_packed,
                self.weight_int16,
                self.scale_int16,
            )
            if t is not None
        ]
        tensors += [self.q, self.scale, self.minimum]
        return sum(t.numel() * t.element_size() for t in tensors)

    def dense_weight(self) -> torch.Tensor:
        if self.weight_fp32 is not None:
            return self.weight_fp32
        if self.format == "int8":
            return self.kernels.dequantize_q8(self.q, self.scale)
        return self.kernels.dequantize_q4(self.q, self.scale, self.minimum)

    def onednn_rows(self) -> int:
        """The fewest rows whose bf16 product runs on the plain copy through oneDNN (when it is
        set): beyond the native row limit, or from :attr:`amx_rows` where that is lower."""
        beyond = self.max_native_rows + 1
        return beyond if self.amx_rows is None else min(self.amx_rows, beyond)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        wide = rows.shape[0] > self.max_native_rows
        bf16 = self.bf16_gate.on
        if bf16 and self.weight_bf16 is not None and rows.shape[0] >= self.onednn_rows():
            out = onednn_bf16(rows, self.weight_bf16).float()
            if self.bias is not None:
                out.add_(self.bias)
        elif bf16 and self.weight_packed is not None:
            out = self.kernels.gemm_bf16(rows, self.weight_packed, self.out_features)
            if self.bias is not None:
                out.add_(self.bias)
        elif bf16 and self.weight_int16 is not None and self.scale_int16 is not None:
            out = self.kernels.gemm_int16(
                rows, self.weight_int16, self.scale_int16, self.out_features
            )
            if self.bias is not None:
                out.add_(self.bias)
        elif wide:
            out = F.linear(rows, self.dense_weight(), self.bias)
        else:
            if self.weight_fp32 is not None:
                out = self.kernels.gemm_f32(rows, self.weight_fp32)
            elif self.format == "int8":
                out = self.kernels.gemm_q8(rows, self.q, self.scale)
            else:
                out = self.kernels.gemm_q4(rows, self.q, self.scale, self.minimum)
            if self.bias is not None:
                out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.format}, "
            f"native up to {self.max_native_rows} rows"
            + (f", bf16 from {self.onednn_rows()} rows" if self.weight_bf16 is not None else "")
            + (", packed bf16" if self.weight_packed is not None else "")
            + (", packed int16" if self.weight_int16 is not None else "")
        )


Weights = list[tuple[torch.Tensor, torch.Tensor | None]]  # (fp32 weight [N, K], bias)


@torch.inference_mode()
def measure_native_rows(
    kernels: NativeKernels, weights: Weights, max_rows: int, margin: float = NATIVE_MARGIN
) -> Measurement:
    """One trial: up to how many rows the native fp32 products beat aten on these weights
    (0: never).

    Row counts are tried from 1 upwards, interleaved round by round against aten and decided on
    the median ratio; the first count where native/aten reaches ``margin`` ends the search. The
    figures hold each count's ratio and median milliseconds (``native_ms_<rows>``,
    ``aten_ms_<rows>``) and the bytes timed, which the steady-state watch compares steps with.
    """
    figures: dict[str, float] = {
        "subset_mb": sum(w.numel() * w.element_size() for w, _ in weights) / 1e6
    }
    best = 0
    with RunQueueWait() as wait:
        for rows in [r for r in ROW_STEPS if r <= max(1, max_rows)]:
            inputs = [torch.randn(rows, weight.shape[1]) for weight, _ in weights]

            def aten(inputs: list[torch.Tensor] = inputs) -> None:
                for (weight, bias), x in zip(weights, inputs, strict=True):
                    F.linear(x, weight, bias)

            def native(inputs: list[torch.Tensor] = inputs) -> None:
                for (weight, _), x in zip(weights, inputs, strict=True):
                    kernels.gemm_f32(x, weight)

            timings = interleaved_timings(aten, native, CALIBRATION_ROUNDS, 1)
            ratio = statistics.median(n / a for a, n in timings)
            figures[f"native_over_aten_{rows}"] = ratio
            figures[f"aten_ms_{rows}"] = statistics.median(a for a, _ in timings) * 1e3
            figures[f"native_ms_{rows}"] = statistics.median(n for _, n in timings) * 1e3
            if ratio >= margin:
                break
            best = rows
    choice = str(best)
    logger.info(
        "native fp32 products against aten (waited for a CPU %s of the time): up to %s rows %s",
        "?" if wait.fraction is None else f"{wait.fraction:.0%}",
        choice,
        {name: round(value, 3) for name, value in figures.items()},
    )
    return Measurement(choice, figures, busy=wait.fraction)


def native_rows_rule(kernels: NativeKernels, max_rows: int, native_step: bool) -> Rule:
    """What the CPU's features say: with the SIMD kernels, native wins at decode sizes (on every
    AVX2 machine measured: 0.3-0.6x aten's time at 1 row; with the whole step native, still
    ahead at 32 rows), up to 32 rows with the native step and 8 without; the plain C products
    never win. A measured count under a quarter of the rule's (or any, against a rule of none)
    contradicts it widely."""
    if not kernels.avx2:
        return Rule("0", "no AVX2/FMA: the plain C products", lambda choice: int(choice) > 0)
    rows = min(max_rows, 32 if native_step else 8)
    return Rule(
        str(rows),
        "the SIMD kernels at decode sizes" + (", whole steps native" if native_step else ""),
        lambda choice: int(choice) * 4 < rows,
    )


# Decode streams every layer's weights from memory; one layer's fit in cache, where a product
# is compute-bound and a tuned GEMM wins. So the crossover is timed on enough layers to
# overflow the caches, as a step does.
CALIBRATION_BYTES = 32 * 2**20


def streamed_linears(decoder: nn.Module) -> list[nn.Linear]:
    """The plain linears of the first layers, up to :data:`CALIBRATION_BYTES` of weights."""
    layers = getattr(decoder, "layers", None)
    if layers is None or not len(layers):
        return first_layer_linears(decoder)
    found: list[nn.Linear] = []
    total = 0
    for layer in layers:
        for module in layer.modules():
            if type(module) is nn.Linear:
                found.append(module)
                total += module.weight.numel() * module.weight.element_size()
        if total >= CALIBRATION_BYTES:
            break
    return found


def fp32_native_layers(module: nn.Module) -> list[NativeLinear]:
    """The fp32 :class:`NativeLinear` layers under ``module``, the fused q/k/v ones included
    (their shared product is not a registered submodule)."""
    found: dict[int, NativeLinear] = {}
    for child in module.modules():
        if isinstance(child, QKVPart):
            child = child.shared.linear
        if isinstance(child, NativeLinear) and child.weight_fp32 is not None:
            found.setdefault(id(child), child)
    return list(found.values())


def streamed_native_weights(decoder: nn.Module) -> Weights:
    """The fp32 native layers of the first layers (after :func:`install_native_fp32`), up to
    :data:`CALIBRATION_BYTES`: what a decision taken again at run time is timed on."""
    found: Weights = []
    total = 0
    for layer in getattr(decoder, "layers", []):
        for native in fp32_native_layers(layer):
            weight = native.weight_fp32
            if weight is not None:
                found.append((weight, native.bias))
                total += weight.numel() * 4
        if total >= CALIBRATION_BYTES:
            break
    return found


def choose_native_rows(
    model: nn.Module,
    kernels: NativeKernels,
    *,
    max_rows: int,
    cache: CalibrationCache | None,
    margin: float = NATIVE_MARGIN,
    native_step: bool = False,
) -> tuple[int, CalibrationRecord | None, NativeRowsQuestion | None]:
    """Up to how many rows this model's fp32 products should run natively (0: none), from
    trials on its first layers (:func:`streamed_linears`) and the CPU-feature rule, or read
    from the calibration cache; native takes a row count where native/aten stays below
    ``margin``. Returns the question too, for the steady-state watch."""
    linears = streamed_linears(model.get_decoder())  # type: ignore[operator]
    if not linears:
        return 0, None, None
    question = NativeRowsQuestion(
        {
            "rows": max_rows,
            "threads": torch.get_num_threads(),
            "kernels": kernels.build.path.name,  # a new kernel build is measured anew
            "shapes": [[linear.out_features, linear.in_features] for linear in linears],
            "margin": margin,
        },
        native_rows_rule(kernels, max_rows, native_step),
    )
    weights: Weights = [(linear.weight.detach().contiguous(), linear.bias) for linear in linears]

    def measure() -> Measurement:
        return measure_native_rows(kernels, weights, max_rows, margin)

    if cache is None:
        measurement = measure()
        record = CalibrationRecord("native_rows", measurement.choice, "measured", 0.0)
    else:
        record = cache.decide("native_rows", question.fields, measure, question.rule)
    return int(record.choice), record, question


@dataclass(frozen=True)
class NativeRowsQuestion:
    fields: dict[str, object]
    rule: Rule


def install_native_fp32(
    model: nn.Module, kernels: NativeKernels, max_native_rows: int
) -> NativeLinear | None:
    """Replace the decoder's linear layers (gate/up and q/k/v fused) with fp32
    :class:`NativeLinear` ones; returns one for the output projection (sharing its weight), or
    None when the model has no plain one."""
    decoder = model.get_decoder()  # type: ignore[operator]

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return NativeLinear(kernels, weight, bias, "float32", max_native_rows)

    count = replace_linears(decoder, make)
    lm_head = model.get_output_embeddings()  # type: ignore[operator]
    logger.info("%d fp32 linear layers native up to %d rows", count, max_native_rows)
    if type(lm_head) is not nn.Linear:
        return None
    return NativeLinear(kernels, lm_head.weight, lm_head.bias, "float32", max_native_rows)
