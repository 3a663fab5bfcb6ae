"""oneDNN-packed linear layers for CPU decoding.

PyTorch's CPU ``F.linear`` calls MKL's sgemm. With the few rows a decode step has (one per
running sequence), that runs far below the machine's peak: measured on a 2-core AMD EPYC, a
1536x576 product with 32 rows took 0.59 ms through MKL and 0.40 ms through oneDNN with the
weight reordered once into oneDNN's blocked layout; the 49152x576 output projection 24 ms and
11 ms. MKL also picks its generic code path on non-Intel CPUs. So on CPU the runner replaces
each ``nn.Linear`` with :class:`PackedLinear` (the same product through
``torch.ops.mkldnn._linear_pointwise``, the op torch.compile emits for CPU linears), after a
calibration on the model's own weights confirms it is faster on this machine.

The calibration alternates the two backends round by round and decides on the median of the
per-round ratios, so a busy moment slows both sides of a round alike and a spike moves one round,
not the answer; the engine caches the decision per CPU kind (core/model/calibration.py).

Packing converts the weight in place of the original, so memory does not grow, except for a
tied output projection (its weight is also the input embedding and stays).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from slotserve.engine.core.model.calibration import (
    CalibrationCache,
    CalibrationRecord,
    Measurement,
    Rule,
    RunQueueWait,
)
from slotserve.engine.core.model.fusion import (
    dense_linear,
    fuse_gated_mlps,
    fuse_qkv,
    replace_linears,
)
from slotserve.engine.settings import LinearBackend

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's reordered layout (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The packed tensor has no storage a state dict could save: keep it a plain attribute.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# Rounds of the interleaved calibration, and calls per side in a round (the best one counts).
CALIBRATION_ROUNDS = 9
CALLS_PER_ROUND = 2
# oneDNN must be this much faster (median per-round ratio) to be chosen: packing is not free.
ONEDNN_MARGIN = 0.9


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def interleaved_timings(
    first: Callable[[], Any], second: Callable[[], Any], rounds: int, calls: int
) -> list[tuple[float, float]]:
    """Per round, the best of ``calls`` timings of each function, their order alternating."""
    first(), second()  # warm-up: first-call allocations and oneDNN primitive creation
    timings = []
    for round_index in range(rounds):
        if round_index % 2 == 0:
            a = _best_seconds(first, calls)
            b = _best_seconds(second, calls)
        else:
            b = _best_seconds(second, calls)
            a = _best_seconds(first, calls)
        timings.append((a, b))
    return timings


@torch.inference_mode()
def measure_linear_backends(linears: list[nn.Linear], rows: int) -> Measurement:
    """Time one layer's products both ways with ``rows`` rows: does packing pay here?

    Interleaved rounds on the real weights, decided on the median per-round ratio; a wrong answer
    costs speed, never correctness. A oneDNN that cannot run here chooses aten (not cached).
    """
    try:
        with RunQueueWait() as wait:
            timings = _time_layer(linears, rows)
    except RuntimeError:
        # A oneDNN build that cannot serve this CPU or layout: the stock products still can.
        logger.warning("oneDNN linear failed in calibration; using aten", exc_info=True)
        return Measurement("aten", cacheable=False)
    ratio = statistics.median(onednn / aten for aten, onednn in timings)
    figures = {
        "rows": float(rows),
        "aten_ms": statistics.median(aten for aten, _ in timings) * 1e3,
        "onednn_ms": statistics.median(onednn for _, onednn in timings) * 1e3,
        "onednn_over_aten": ratio,
    }
    choice = "onednn" if ratio < ONEDNN_MARGIN else "aten"
    logger.info(
        "linear calibration, %d rows, %d interleaved rounds: aten %.3f ms, onednn %.3f ms "
        "(median ratio %.2f): %s",
        rows,
        len(timings),
        figures["aten_ms"],
        figures["onednn_ms"],
        ratio,
        choice,
    )
    return Measurement(choice, figures, busy=wait.fraction)


# Where the measurement cannot be trusted: oneDNN's packed products won on every CPU measured
# (median ratios 0.42-0.69 on the EPYCs); a measured aten is confirmed before it is believed.
ONEDNN_RULE = Rule("onednn", "oneDNN's packed products on CPU", lambda choice: choice != "onednn")


def _time_layer(linears: list[nn.Linear], rows: int) -> list[tuple[float, float]]:
    weight = linears[0].weight
    inputs = [
        torch.randn(rows, linear.in_features, dtype=weight.dtype, device=weight.device)
        for linear in linears
    ]
    packed = [PackedLinear.from_linear(linear) for linear in linears]

    def aten() -> None:
        for linear, x in zip(linears, inputs, strict=True):
            linear(x)

    def onednn() -> None:
        for linear, x in zip(packed, inputs, strict=True):
            linear(x)

    return interleaved_timings(aten, onednn, CALIBRATION_ROUNDS, CALLS_PER_ROUND)


def first_layer_linears(decoder: nn.Module) -> list[nn.Linear]:
    layers = getattr(decoder, "layers", None)
    scope = layers[0] if layers is not None and len(layers) else decoder
    return [m for m in scope.modules() if type(m) is nn.Linear]


def choose_linear_backend(
    model: Any, backend: LinearBackend, *, max_rows: int, cache: CalibrationCache | None = None
) -> tuple[LinearBackend, CalibrationRecord | None]:
    """Resolve ``auto`` to ``onednn`` or ``aten`` for this model and machine.

    ``auto`` chooses oneDNN when it serves this dtype and device and the calibration (at
    ``max_rows`` rows, the widest decode step) finds it faster; with a ``cache`` the decision
    is read from, or written to, the calibration cache. Returns the backend and the record of
    the decision (None when nothing was decided: an explicit backend, or nothing to pack).
    """
    param = next(model.parameters())
    if backend != "auto":
        return backend, None
    if not onednn_supported(param.device, param.dtype):
        return "aten", None
    decoder = model.get_decoder()
    linears = first_layer_linears(decoder)
    if not linears:
        # Packed already (a second runner on the same model) or nothing to pack.
        packed = any(isinstance(m, PackedLinear) for m in decoder.modules())
        return ("onednn" if packed else "aten"), None
    rows = max(2, max_rows)
    question = {
        "dtype": str(param.dtype),
        "rows": rows,
        "threads": torch.get_num_threads(),
        "shapes": [[linear.out_features, linear.in_features] for linear in linears],
    }

    def measure() -> Measurement:
        return measure_linear_backends(linears, rows)

    start = time.perf_counter()
    if cache is None:
        measurement = measure()
        record = CalibrationRecord(
            "linear_backend",
            measurement.choice,
            "measured",
            time.perf_counter() - start,
            measurement.figures,
        )
    else:
        record = cache.decide("linear_backend", question, measure, ONEDNN_RULE)
    return ("onednn" if record.choice == "onednn" else "aten"), record


def pack_linears(
    model: Any, backend: LinearBackend, *, max_rows: int
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Replace the decoder's ``nn.Linear`` modules with :class:`PackedLinear` when it pays.

    ``auto`` measures (see :func:`choose_linear_backend`); ``onednn`` always packs where
    supported; ``aten`` never packs. Returns a packed output projection for the logits (the
    model's own may be tied to the input embedding, so it is left in place), or None.
    """
    param = next(model.parameters())
    backend, _record = choose_linear_backend(model, backend, max_rows=max_rows)
    if backend == "aten" or not onednn_supported(param.device, param.dtype):
        # Stock products still gain from fewer, larger calls: q/k/v and gate/up fused.
        decoder = model.get_decoder()
        fuse_gated_mlps(decoder)
        fuse_qkv(decoder, dense_linear)
        return None
    decoder = model.get_decoder()
    linears = first_layer_linears(decoder)
    if not linears and not any(isinstance(m, PackedLinear) for m in decoder.modules()):
        return None
    count = replace_linears(decoder, PackedLinear)
    lm_head = model.get_output_embeddings()
    logits = PackedLinear.from_linear(lm_head) if type(lm_head) is nn.Linear else None
    logger.info("packed %d linear layers%s for oneDNN", count, " and lm_head" if logits else "")
    return logits


def aten_logits(lm_head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The output projection without oneDNN: on CPU, arranged for MKL.

    MKL's F.linear with a 49152-row output matrix ran 1.5-3x slower than the same product
    written as W @ x.T (several rows) or x @ W.T stored contiguous (one row). The transposed
    copy costs one more output matrix of RAM.
    """
    weight = getattr(lm_head, "weight", None)
    if weight is None or weight.device.type != "cpu" or getattr(lm_head, "bias", None) is not None:
        return lm_head
    weight = weight.detach()
    weight_t = weight.t().contiguous()

    def project(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 1:
            return hidden @ weight_t
        return torch.mm(weight, hidden.t()).t()

    return project
