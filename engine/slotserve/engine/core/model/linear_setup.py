"""Which linear layers a model runs with, decided here and nowhere else, once at load (by
:func:`~slotserve.engine.core.model.prepare.prepare_model`): quantized, native fp32,
oneDNN-packed or stock, and the layer that computes the logits.

- ``quantization`` int8/int4: every decoder linear is quantized onto the native kernels, the
  output projection int8 (:mod:`slotserve.engine.core.model.quantize`).
- fp32 on CPU with the native kernels built: decode-sized products run natively up to the row
  count where they stop beating aten (``auto``: measured and cached; ``native``: every decode
  step), larger ones through torch (:mod:`slotserve.engine.core.model.native_linear`).
- otherwise oneDNN-packed where that measured faster, else the stock layers
  (:mod:`slotserve.engine.core.model.linear`).

Every choice and what it cost at load is returned as calibration records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from slotserve.contracts.engine_argv import Quantization
from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.kernels import NativeKernels
from slotserve.engine.core.model.calibration import CalibrationCache, CalibrationRecord, Measurement
from slotserve.engine.core.model.linear import aten_logits, choose_linear_backend, pack_linears
from slotserve.engine.core.model.native_linear import (
    NATIVE_MARGIN,
    NATIVE_STEP_MARGIN,
    NativeLinear,
    NativeRowsQuestion,
    choose_native_rows,
    fp32_native_layers,
    install_native_fp32,
    measure_native_rows,
    native_rows_rule,
    streamed_native_weights,
)
from slotserve.engine.core.model.native_rows_watch import NativeRowsWatch
from slotserve.engine.core.model.quantize import quantize_model
from slotserve.engine.settings import LinearBackend

logger = logging.getLogger(__name__)

# The dtype of decode products on the native kernels, where narrower than fp32.
NarrowDecode = Literal["bf16", "int16"]


@dataclass
class LinearLayers:
    logits: Callable[[torch.Tensor], torch.Tensor]
    calibrations: list[CalibrationRecord] = field(default_factory=list)
    # Checks the native-rows decision against the steady-state decode steps (fp32, auto).
    watch: NativeRowsWatch | None = None


def set_up_linears(
    model: Any,
    native: NativeKernels | None,
    *,
    linear_backend: LinearBackend,
    quantization: Quantization,
    num_slots: int,
    calibration: CalibrationCache | None,
    native_step: bool = False,
    native_for_prefill: bool = False,
    narrow_decode: NarrowDecode | None = None,
) -> LinearLayers:
    """Replace ``model``'s linear layers as decided here (in place); see the module doc.
    ``native_step``: decode steps will run as one native call where the layers are native, so
    native products are taken up to :data:`NATIVE_STEP_MARGIN` of aten's time.
    ``native_for_prefill``: the layers become native even where aten wins every decode size
    (native up to 0 rows: each product is aten's F.linear, as the stock layer's), so that the
    native step, with its bf16 prefill products, exists for prefill chunks.
    ``narrow_decode``: ``"bf16"`` or ``"int16"`` where decode products will run on the native
    kernels in that dtype (bf16_decode.py, int16_products.py), which beat aten's fp32 products
    structurally: native up to the CPU-feature rule's row count, nothing measured."""
    if quantization == "int8" or quantization == "int4":
        if native is None:
            raise UnsupportedSettingError(
                f"quantization {quantization} runs on the native kernels: a CPU, float32 "
                "weights and a C compiler (gcc) to build them"
            )
        return _quantized(model, quantization, native)
    if linear_backend == "native" and native is None:
        raise UnsupportedSettingError(
            "linear_backend native needs the native kernels: a CPU, float32 weights and a C "
            "compiler (gcc) to build them"
        )
    calibrations: list[CalibrationRecord] = []
    rows_record = question = None
    products_bytes = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.get_decoder().modules()
        if type(m) is torch.nn.Linear
    )
    if native is not None and linear_backend in ("auto", "native"):
        if linear_backend == "native":
            native_rows = num_slots
        elif narrow_decode is not None:
            rule = native_rows_rule(native, num_slots, native_step)
            native_rows = int(rule.choice)
            figures = {f"{narrow_decode}_decode": 1.0}
            calibrations.append(CalibrationRecord("native_rows", rule.choice, "rule", 0.0, figures))
        else:
            margin = NATIVE_STEP_MARGIN if native_step else NATIVE_MARGIN
            native_rows, rows_record, question = choose_native_rows(
                model,
                native,
                max_rows=num_slots,
                cache=calibration,
                margin=margin,
                native_step=native_step,
            )
            calibrations += [rows_record] if rows_record is not None else []
        if native_rows > 0 or native_for_prefill:
            native_logits = install_native_fp32(model, native, native_rows)
            layers = LinearLayers(
                native_logits or aten_logits(model.get_output_embeddings()), calibrations
            )
            layers.watch = _watch(
                model, native, layers, rows_record, question, calibration, products_bytes, 1.0
            )
            layers.calibrations.append(kernels_record(native))
            return layers
    backend, record = choose_linear_backend(
        model,
        "auto" if linear_backend == "native" else linear_backend,
        max_rows=num_slots,
        cache=calibration,
    )
    calibrations += [record] if record is not None else []
    logits = pack_linears(model, backend, max_rows=num_slots) or aten_logits(
        model.get_output_embeddings()
    )
    layers = LinearLayers(logits, calibrations)
    stock_over_aten = 1.0
    if backend == "onednn" and record is not None:
        stock_over_aten = record.figures.get("onednn_over_aten", 1.0)
    if native is not None:
        layers.calibrations.append(kernels_record(native))
        layers.watch = _watch(
            model, native, layers, rows_record, question, calibration, products_bytes,
            stock_over_aten,
        )  # fmt: skip
    return layers


def _watch(
    model: Any,
    kernels: NativeKernels,
    layers: LinearLayers,
    record: CalibrationRecord | None,
    question: NativeRowsQuestion | None,
    cache: CalibrationCache | None,
    products_bytes: int,
    stock_over_aten: float,
) -> NativeRowsWatch | None:
    """The steady-state check of a native-rows decision (a rule's carries the timings of the
    trial it overruled, if one measured: steps that beat them say that trial ran on a busy
    machine, and the decision is taken again)."""
    if record is None or question is None or cache is None:
        return None
    natives = fp32_native_layers(model.get_decoder())
    if isinstance(layers.logits, NativeLinear):
        natives.append(layers.logits)
    max_rows = int(question.fields["rows"])  # type: ignore[call-overload]
    margin = float(question.fields["margin"])  # type: ignore[arg-type]

    def retake() -> CalibrationRecord:
        weights = streamed_native_weights(model.get_decoder())

        def measure() -> Measurement:
            return measure_native_rows(kernels, weights, max_rows, margin)

        return cache.decide("native_rows", question.fields, measure, question.rule)

    def apply(rows: int) -> bool:
        for module in natives:
            module.max_native_rows = rows
        return bool(natives)

    watch = NativeRowsWatch(
        cache=cache,
        question=question.fields,
        record=record,
        products_bytes=products_bytes,
        stock_over_aten=stock_over_aten,
        retake=retake if natives else None,
        apply=apply,
    )
    watch.attach(model.get_decoder())
    return watch


def kernels_record(kernels: NativeKernels) -> CalibrationRecord:
    """What the native kernels cost at load (compiled, or loaded from the image or the cache)
    and which instruction set they run (``avx512_bf16``, ``avx512``, ``avx2_fma`` or
    ``plain_c``; figure ``int16_avx512_vnni`` or ``int16_avx2`` 1: what their int16 products
    run, VPDPWSSD or VPMADDWD)."""
    return CalibrationRecord(
        "native_kernels",
        kernels.isa,
        "built" if kernels.build.compiled else "cached",
        kernels.build.seconds,
        {} if kernels.int16_products == "plain_c" else {f"int16_{kernels.int16_products}": 1.0},
    )


def _quantized(
    model: Any, quantization: Literal["int8", "int4"], kernels: NativeKernels
) -> LinearLayers:
    report = quantize_model(model, quantization, kernels)
    records = [
        kernels_record(kernels),
        CalibrationRecord(
            "quantization",
            quantization,
            "built",
            report.seconds,
            {
                "layers": float(report.num_layers),
                "mb_before": report.bytes_before / 1e6,
                "mb_after": report.bytes_after / 1e6,
            },
        ),
    ]
    return LinearLayers(model.get_output_embeddings(), records)
