"""A loaded model made ready for the engine, once: its attention, its linear layers and the
layer that computes the logits.

:func:`prepare_model` does all the layer surgery a model gets (runners only read it), so any
number of runners can be built on one :class:`PreparedModel`: a served engine builds one, a
benchmark one per batch size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slotserve.contracts.engine_argv import Quantization
from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.kernels import NativeKernels
from slotserve.engine.core.model.attention import register_slot_attention
from slotserve.engine.core.model.bf16_decode import install_bf16_decode, wants_bf16_decode
from slotserve.engine.core.model.bf16_prefill import (
    Bf16Gate,
    bf16_units,
    install_bf16_prefill,
    wants_bf16_prefill,
)
from slotserve.engine.core.model.calibration import CalibrationCache, CalibrationRecord
from slotserve.engine.core.model.int16_products import install_int16, plan_int16, wants_int16
from slotserve.engine.core.model.linear_setup import NarrowDecode, set_up_linears
from slotserve.engine.core.model.native_decode import NativeDecodeStep, native_step, step_eligible
from slotserve.engine.settings import DecodeDType, DecodeStep, LinearBackend, PrefillDType

logger = logging.getLogger(__name__)


def is_static(decode_step: str) -> bool:
    """Whether ``decode_step`` is the static step (eager or compiled): stock products on
    fixed buffers, no C kernels, no packing."""
    return decode_step in ("static", "compiled")


@dataclass(frozen=True)
class PreparedModel:
    """A model whose layers are set up, and what every runner built on it shares."""

    model: Any
    logits: Callable[[torch.Tensor], torch.Tensor]
    # The native kernels the layers and decode attention run on; None: torch only.
    kernels: NativeKernels | None
    # What was decided (or measured) at load, and what it cost.
    calibrations: list[CalibrationRecord]
    decode_step: DecodeStep
    # Runners build the native step over their KV rows where the model's layers allow it.
    native_decode: bool
    # Shared by the layers' bf16 weights (the runner sets it per step); None: no bf16 weights.
    bf16_gate: Bf16Gate | None
    # Which products run in bf16 (with the gate on): prefill chunks', decode rows'.
    bf16_prefill: bool = False
    bf16_decode: bool = False

    @property
    def static(self) -> bool:
        """Whether decode steps run the static step (stock products, no C kernels)."""
        return is_static(self.decode_step)

    def native_step(
        self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]
    ) -> NativeDecodeStep | None:
        """The native step over a runner's KV rows, or None where it cannot run (logged)."""
        if not self.native_decode:
            return None
        step = native_step(self.model, self.kernels, k_cache, v_cache)
        gate = self.bf16_gate
        if step is None or gate is None:
            return step
        # bf16 products in the native step: its wide products calling back into oneDNN's bf16
        # GEMM (plain weights), every product on the packed weights, or quantized weights
        # widened to bf16 as they are multiplied; a prefill that can have none runs through the
        # layers' torch path.
        callback = step.use_bf16_products(gate)
        packed = step.use_packed_bf16(gate) or step.use_packed_int16(gate)
        quantized = step.use_quantized_bf16(gate)
        if self.bf16_prefill and not (callback or packed or quantized):
            step.prefill = False
        return step


def prepare_model(
    model: Any,
    kernels: NativeKernels | None,
    *,
    max_rows: int,
    calibration: CalibrationCache | None = None,
    linear_backend: LinearBackend = "auto",
    quantization: Quantization = "none",
    native_decode: bool = True,
    decode_step: DecodeStep = "classic",
    prefill_dtype: PrefillDType = "float32",
    decode_dtype: DecodeDType = "float32",
) -> PreparedModel:
    """Set up ``model``'s layers in place for runners of up to ``max_rows`` slots.

    ``kernels``: the native kernels the loader found for this device and dtype (None: torch
    only; quantization needs them). The static decode step (``decode_step`` static or
    compiled) runs the model's stock modules: no C kernels, no packing."""
    model.set_attn_implementation(register_slot_attention())
    if is_static(decode_step):
        if quantization != "none" or linear_backend not in ("auto", "aten"):
            raise UnsupportedSettingError(
                f"decode_step {decode_step} runs stock products: it needs quantization none "
                f"and linear_backend auto or aten (got {quantization}, {linear_backend})"
            )
        kernels, native_decode, linear_backend = None, False, "aten"
    # The CPU's bf16 units, read once: they decide whether prefill multiplies in bf16.
    cpu_units = bf16_units()
    units = cpu_units if prefill_dtype != "float32" else []
    # int16 products (AVX512_VNNI without bf16 units, or asked for) on fp32 weights only.
    int16 = plan_int16(prefill_dtype, decode_dtype, quantization, cpu_units, kernels)
    decode_bf16 = decode_dtype != "int16" and wants_bf16_decode(decode_dtype, quantization, kernels)
    if int16 and (decode_bf16 or (not int16.prefill and units)):
        # One gate turns a step's narrow products on: the layers cannot hold both kinds apart.
        logger.info("bf16 products off: int16 (asked for) takes the layers' gate")
        decode_bf16 = False
    # The decode products' narrow dtype, if any: int16's beat aten's fp32 ones structurally,
    # as bf16's do.
    narrow_decode: NarrowDecode | None = None
    if decode_bf16:
        narrow_decode = "bf16"
    elif int16.decode and wants_int16("int16", [], kernels):
        narrow_decode = "int16"
    eligible = step_eligible(model)
    native_step = native_decode and kernels is not None and eligible
    layers = set_up_linears(
        model,
        kernels,
        linear_backend=linear_backend,
        quantization=quantization,
        num_slots=max_rows,
        calibration=calibration,
        native_step=native_step,
        native_for_prefill=native_decode
        and eligible
        and (bool(int16) or wants_bf16_prefill(prefill_dtype, quantization, units)),
        narrow_decode=narrow_decode,
    )
    if int16:
        gate = install_int16(model, kernels, int16)
        prefill_gate = gate if int16.prefill else None
        decode_gate = gate if int16.decode else None
    else:
        prefill_gate = install_bf16_prefill(
            model, prefill_dtype, units, kernels, native_step=native_step
        )
        decode_gate = (
            install_bf16_decode(model, layers.logits, prefill_gate, native_step=native_step)
            if decode_bf16
            else None
        )
    return PreparedModel(
        model=model,
        logits=layers.logits,
        kernels=kernels,
        calibrations=layers.calibrations,
        decode_step=decode_step,
        native_decode=native_decode,
        bf16_gate=decode_gate or prefill_gate,
        bf16_prefill=prefill_gate is not None,
        bf16_decode=decode_gate is not None,
    )
