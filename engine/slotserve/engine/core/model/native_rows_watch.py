"""The native-rows decision, checked against the engine's own steady-state decode steps.

A cached decision carries the timings it was taken from: per row count, the milliseconds of
the native and aten products over the first layers' weights. Scaled to all of the decoder's
weights, that is what the products alone of a step should cost on the path the decision chose.
A step (products, attention, norms and logits) that runs in under :data:`FASTER` of that, over
:data:`STEADY_STEPS` steps, says the decision was timed on a machine much slower than this one
is now: a busy start. The decision is then dropped from the cache and taken again (trials and
the rule, once per engine), and applied at once where the layers are native (the row limit of
every native layer, which the native step follows), else from the next start. Every
:data:`REREAD_EVERY` steps the cache is read again, so a decision another engine of the pool
re-took is adopted here too.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from torch import nn

from slotserve.engine.core.model.calibration import CalibrationCache, CalibrationRecord

logger = logging.getLogger(__name__)

STEADY_STEPS = 24  # decode steps of one row count whose median is compared
WARM_UP_STEPS = 4  # the engine's first steps (allocations, first touches) are not counted
FASTER = 0.5  # a step in under this share of its products' recorded time contradicts them
REREAD_EVERY = 256  # steps between reads of the cached decision
# The decoder attribute through which the native decode step reports its timings.
STEP_OBSERVER = "slotserve_step_observer"


class NativeRowsWatch:
    """Feeds on decode-only step timings (:meth:`observe`); see the module doc."""

    def __init__(
        self,
        *,
        cache: CalibrationCache,
        question: dict[str, object],
        record: CalibrationRecord,
        products_bytes: int,
        stock_over_aten: float,
        retake: Callable[[], CalibrationRecord] | None,
        apply: Callable[[int], bool],
    ) -> None:
        """``products_bytes``: the decoder's linear weights; ``stock_over_aten``: the stock
        layers' time over aten's (oneDNN's measured ratio where packed, else 1); ``retake``
        takes the decision again (None: the layers are not native, so the next start does);
        ``apply`` sets a row limit live (False: it cannot)."""
        self.cache = cache
        self.question = question
        self.products_bytes = products_bytes
        self.stock_over_aten = stock_over_aten
        self.retake = retake
        self.apply = apply
        self.rows = int(record.choice)
        self.figures = dict(record.figures)
        self.pending: int | None = None  # a choice that could not be applied live
        self.retaken = False
        self.steps = 0
        self.samples: dict[int, deque[float]] = {}

    def attach(self, decoder: nn.Module) -> None:
        """Observe the decoder's decode-only steps: through transformers (forward hooks; a step
        with a prefill chunk is not counted) and the native step (which reads
        :data:`STEP_OBSERVER`). The products are timed with the rest of the decoder, never
        with the logits or sampling."""
        started: list[float] = []

        def before(_module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
            step = kwargs.get("slot_step")
            started[:] = [time.perf_counter()] if step is not None and not step.prefills else []

        def after(_module: nn.Module, _args: Any, kwargs: dict[str, Any], _output: Any) -> None:
            if started:
                self.observe(kwargs["slot_step"].num_tokens, time.perf_counter() - started[0])

        decoder.register_forward_pre_hook(before, with_kwargs=True)
        decoder.register_forward_hook(after, with_kwargs=True)
        setattr(decoder, STEP_OBSERVER, self.observe)

    def predicted_seconds(self, rows: int) -> float | None:
        """The recorded time of a step's products at ``rows`` on the path chosen for it."""
        native = rows <= self.rows
        milliseconds = self.figures.get(f"{'native' if native else 'aten'}_ms_{rows}")
        subset_mb = self.figures.get("subset_mb")
        if milliseconds is None or not subset_mb:
            return None  # not a row count that was timed, or a rule's decision
        scale = self.products_bytes / (subset_mb * 1e6)
        return milliseconds / 1e3 * scale * (1.0 if native else self.stock_over_aten)

    def observe(self, rows: int, seconds: float) -> None:
        self.steps += 1
        if self.steps % REREAD_EVERY == 0:
            self._adopt_cached()
        if self.retaken or self.steps <= WARM_UP_STEPS:
            return
        predicted = self.predicted_seconds(rows)
        if predicted is None:
            return
        samples = self.samples.setdefault(rows, deque(maxlen=STEADY_STEPS))
        samples.append(seconds)
        if len(samples) < STEADY_STEPS:
            return
        median = statistics.median(samples)
        samples.clear()
        if median < FASTER * predicted:
            self._retake(
                f"decode steps of {rows} rows took {median * 1e3:.1f} ms, under "
                f"{FASTER:.0%} of the {predicted * 1e3:.1f} ms its products were timed at"
            )

    def _retake(self, why: str) -> None:
        self.retaken = True  # once per engine: a re-take costs seconds of measuring
        self.cache.drop("native_rows", self.question, why)
        if self.retake is None:
            logger.warning("native_rows: the next start takes the decision again")
            return
        record = self.retake()
        self.figures = dict(record.figures)
        self._set(int(record.choice), f"taken again ({record.source})")

    def _adopt_cached(self) -> None:
        choice = self.cache.read("native_rows", self.question)
        if choice is not None and int(choice) not in (self.rows, self.pending):
            self._set(int(choice), "re-taken by another engine")

    def _set(self, rows: int, how: str) -> None:
        if rows == self.rows:
            logger.info("native_rows %s: %d rows, as before", how, rows)
            return
        live = self.apply(rows)
        logger.warning(
            "native_rows %s: %d rows (was %d), %s",
            how,
            rows,
            self.rows,
            "applied now" if live else "from the next start (the layers are not native)",
        )
        if live:
            self.rows = rows
        else:
            self.pending = rows
