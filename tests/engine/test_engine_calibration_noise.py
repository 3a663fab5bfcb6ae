"""A calibration one busy start cannot poison (issue 24, item 3).

No single trial decides; trials that waited for a CPU, or disagree, give way to the rule from
CPU features; a choice that contradicts the rule widely is measured again; a cached decision the
engine's own steady-state steps contradict is dropped and taken again. And the issue's test:
calibrating next to two real busy-loop processes must not leave steps slower than 0.85x of a
quiet start's, on a fresh home or on the next start from it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slotserve.engine.core.kernels import load_kernels
from slotserve.engine.core.model import calibration
from slotserve.engine.core.model.calibration import (
    BUSY_WAIT_FRACTION,
    CalibrationCache,
    CalibrationRecord,
    Measurement,
    Rule,
    RunQueueWait,
)
from slotserve.engine.core.model.native_linear import (
    NATIVE_STEP_MARGIN,
    NativeLinear,
    choose_native_rows,
)
from slotserve.engine.core.model.native_rows_watch import (
    STEADY_STEPS,
    WARM_UP_STEPS,
    NativeRowsWatch,
)
from slotserve.settings import CommonSettings

# Spawns CPU hogs and times steps: run alone (make test runs `serial` tests after the rest).
pytestmark = pytest.mark.serial

CPU = {"cpu_model": "Test CPU", "cpu_flags": "avx2 fma", "machine": "x86_64", "torch": "t"}
QUESTION: dict[str, object] = {"rows": 8}
RULE = Rule("8", "test rule", lambda choice: int(choice) * 4 < 8)


class Trials:
    """Measurements handed out in order (the last one repeats)."""

    def __init__(self, *trials: Measurement) -> None:
        self.trials = list(trials)
        self.calls = 0

    def __call__(self) -> Measurement:
        self.calls += 1
        return self.trials[min(self.calls, len(self.trials)) - 1]


def quiet(choice: str) -> Measurement:
    return Measurement(choice, {"native_ms_1": 1.0}, busy=0.02)


def decide(home: Path, measure: Trials) -> CalibrationRecord:
    return CalibrationCache(home, CPU).decide("native_rows", QUESTION, measure, RULE)


def test_two_quiet_trials_that_agree_decide(tmp_path):
    record = decide(tmp_path, trials := Trials(quiet("4")))
    assert (record.source, record.choice, trials.calls) == ("measured", "4", 2)
    assert decide(tmp_path, Trials(quiet("1"))).source == "cached"


@pytest.mark.parametrize(
    "given",
    [
        (quiet("4"), quiet("2")),  # disagree
        (quiet("4"), Measurement("4", busy=0.6)),  # the second waited for a CPU
        (Measurement("0", busy=0.7),),  # a busy start: what the old code cached forever
    ],
)
def test_untrustworthy_trials_take_the_rule_provisionally(tmp_path, monkeypatch, given):
    record = decide(tmp_path, Trials(*given))
    assert (record.source, record.choice) == ("rule", "8")
    # Engines starting meanwhile read it (so a pool agrees); a later start measures again.
    assert decide(tmp_path, Trials(quiet("2"))).choice == "8"
    monkeypatch.setattr(calibration, "PROVISIONAL_RETRY_SECONDS", 0.0)
    again = decide(tmp_path, Trials(quiet("4")))
    assert (again.source, again.choice) == ("measured", "4")
    assert decide(tmp_path, Trials(quiet("2"))).source == "cached"


def test_a_trial_that_could_not_measure_takes_the_rule_uncached(tmp_path):
    record = decide(tmp_path, Trials(Measurement("4", cacheable=False)))
    assert (record.source, record.choice) == ("rule", "8")
    assert decide(tmp_path, Trials(quiet("2"))).source == "measured"


def test_provisional_rules_are_retried_a_bounded_number_of_times(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "PROVISIONAL_RETRY_SECONDS", 0.0)
    busy = Measurement("0", busy=0.9)
    sources = [decide(tmp_path, Trials(busy)).source for _ in range(5)]
    assert sources == ["rule", "rule", "rule", "cached", "cached"]


def test_a_choice_against_the_rule_is_measured_again_before_it_is_believed(tmp_path):
    # Native never winning, against a rule of 8 rows: confirmed by two more quiet trials.
    record = decide(tmp_path, trials := Trials(quiet("0")))
    assert (record.source, record.choice, trials.calls) == ("measured", "0", 4)
    # Not confirmed: the rule, never the lone result.
    other = tmp_path / "other"
    record = decide(other, Trials(quiet("0"), quiet("0"), quiet("8"), quiet("8")))
    assert (record.source, record.choice) == ("rule", "8")
    stored = json.loads(next(other.glob("native_rows-*.json")).read_text())
    assert (stored["choice"], stored["provisional"]) == ("8", True)


def hog() -> None:
    end = time.monotonic() + 120
    while time.monotonic() < end:
        pass


@pytest.fixture
def hogs() -> Iterator[None]:
    """A real busy-loop process per CPU this process may run on (two on these machines)."""
    context = multiprocessing.get_context("spawn")
    count = max(2, len(os.sched_getaffinity(0)))
    hogs = [context.Process(target=hog, daemon=True) for _ in range(count)]
    for process in hogs:
        process.start()
    time.sleep(1.0)  # started and spinning
    try:
        yield
    finally:
        for process in hogs:
            process.kill()
            process.join(10)


def busy_work() -> None:
    x, w = torch.randn(64, 512), torch.randn(2048, 512)
    for _ in range(60):
        F.linear(x, w)


def test_the_run_queue_wait_sees_busy_neighbours(hogs):
    torch.set_num_threads(2)
    with RunQueueWait() as wait:
        busy_work()
    assert wait.fraction is not None and wait.fraction > BUSY_WAIT_FRACTION


# -- the steady-state watch ----------------------------------------------------------------------


class Applied:
    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, rows: int) -> bool:
        self.rows.append(rows)
        return True


def watched(tmp_path: Path, figures: dict[str, float], retaken: str) -> tuple:
    cache = CalibrationCache(tmp_path, CPU)
    decide(tmp_path, Trials(quiet("1")))  # the decision the engine started with
    applied, retakes = Applied(), []

    def retake() -> CalibrationRecord:
        record = decide(tmp_path, Trials(quiet(retaken)))
        retakes.append(record)
        return record

    record = CalibrationRecord("native_rows", "1", "cached", 0.0, figures)
    watch = NativeRowsWatch(
        cache=cache,
        question=QUESTION,
        record=record,
        products_bytes=10_000_000,
        stock_over_aten=1.0,
        retake=retake,
        apply=applied,
    )
    return watch, applied, retakes


def test_steps_faster_than_the_decision_was_timed_drop_and_retake_it(tmp_path):
    # Timed on a busy start: 1 MB of products in 5 ms, so the 10 MB step's products 50 ms.
    figures = {"subset_mb": 1.0, "native_ms_1": 5.0, "aten_ms_2": 2.0, "native_ms_2": 9.0}
    watch, applied, retakes = watched(tmp_path, figures, retaken="8")
    for _ in range(WARM_UP_STEPS + STEADY_STEPS - 1):
        watch.observe(1, 0.010)  # the step takes 10 ms: a fifth of its products' recorded time
    assert retakes == []
    watch.observe(1, 0.010)
    assert [r.choice for r in retakes] == ["8"] and retakes[0].source == "measured"
    assert applied.rows == [8] and watch.rows == 8
    (stored,) = tmp_path.glob("native_rows-*.json")
    assert json.loads(stored.read_text())["choice"] == "8"  # re-taken, for the next start too
    for _ in range(3 * STEADY_STEPS):
        watch.observe(1, 0.001)
    assert len(retakes) == 1  # once per engine


def test_steps_as_slow_as_timed_or_slower_keep_the_decision(tmp_path):
    figures = {"subset_mb": 1.0, "native_ms_1": 1.0, "aten_ms_2": 2.0}
    watch, applied, retakes = watched(tmp_path, figures, retaken="8")
    for _ in range(WARM_UP_STEPS + 4 * STEADY_STEPS):
        watch.observe(1, 0.012)  # 10 ms of products predicted: a step of 12 ms agrees
        watch.observe(2, 0.500)  # a busy present never contradicts a decision
        watch.observe(3, 0.001)  # a row count never timed is not compared
    assert (retakes, applied.rows) == ([], [])


def test_a_decision_another_engine_retook_is_adopted(tmp_path, monkeypatch):
    monkeypatch.setattr("slotserve.engine.core.model.native_rows_watch.REREAD_EVERY", 10)
    watch, applied, _ = watched(tmp_path, {"subset_mb": 1.0}, retaken="8")
    (stored,) = tmp_path.glob("native_rows-*.json")
    record = json.loads(stored.read_text())
    stored.write_text(json.dumps({**record, "choice": "4"}))
    for _ in range(10):
        watch.observe(1, 0.01)
    assert applied.rows == [4]


def test_a_runner_applies_a_retaken_decision_live(tmp_path, monkeypatch):
    """A real runner whose cached decision was timed 1000x slower than this machine: its decode
    steps contradict it, the decision is taken again and its native layers follow at once."""
    from slotserve.engine.core.model import native_linear
    from tests.engine.engine_core_support import runner_on
    from tests.engine.test_engine_calibration import tiny_llama

    slow = {"subset_mb": 0.1, **{f"native_ms_{r}": 1000.0 for r in (1, 2, 4)}}
    monkeypatch.setattr(native_linear, "measure_native_rows", lambda *a: quiet_rows("1", slow))
    first = runner_on(
        tiny_llama(), num_slots=4, max_model_len=64, calibration=CalibrationCache(tmp_path, CPU)
    )
    assert first.calibrations[0].choice == "1"
    monkeypatch.setattr(native_linear, "measure_native_rows", lambda *a: quiet_rows("2", {}))
    monkeypatch.setattr(
        "slotserve.engine.core.model.linear_setup.measure_native_rows",
        lambda *a: quiet_rows("2", {}),
    )
    runner = runner_on(
        tiny_llama(), num_slots=4, max_model_len=64, calibration=CalibrationCache(tmp_path, CPU)
    )
    assert runner.calibrations[0].source == "cached"
    assert runner.native_step is not None and runner.native_step.max_rows == 1
    for step in range(WARM_UP_STEPS + STEADY_STEPS):
        runner.native_step([5], [step], [0])
    assert runner.native_step.max_rows == 2  # taken again, applied live
    o_proj = runner.model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, NativeLinear) and o_proj.max_native_rows == 2
    (stored,) = tmp_path.glob("native_rows-*.json")
    assert json.loads(stored.read_text())["choice"] == "2"


def quiet_rows(choice: str, figures: dict[str, float]) -> Measurement:
    return Measurement(choice, figures, busy=0.0)


# -- the test: two hogs at calibration -----------------------------------------------


def step_products_seconds(weights: list[torch.Tensor], rows: int, native: bool, kernels) -> float:
    x = [torch.randn(rows, w.shape[1]) for w in weights]
    start = time.perf_counter()
    for w, xi in zip(weights, x, strict=True):
        if native:
            kernels.gemm_f32(xi, w)
        else:
            F.linear(xi, w)
    return time.perf_counter() - start


@pytest.mark.slow
def test_calibrating_next_to_two_hogs_does_not_slow_the_steps(smollm2_dir, tmp_path):
    """SmolLM2's native-rows decision taken quietly, next to two busy loops on a fresh home,
    and on the next start from that home: at 1, 4 and 8 rows the steps of the latter two must
    run at least 0.85x as fast as the quiet one's. Where the decisions agree at a row count the
    steps are the same code; where they differ, the products of every decoder layer are timed
    both ways, interleaved, and compared (the median of 5 pairs, or of 15 when 5 read slow)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    kernels = load_kernels(CommonSettings().home)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()

    def decision(home: Path) -> int:
        rows, _record, _question = choose_native_rows(
            model,
            kernels,
            max_rows=8,
            cache=CalibrationCache(home),
            margin=NATIVE_STEP_MARGIN,
            native_step=True,
        )
        return rows

    quiet_rows_chosen = decision(tmp_path / "quiet")
    context = multiprocessing.get_context("spawn")
    hogs = [context.Process(target=hog, daemon=True) for _ in range(2)]
    for process in hogs:
        process.start()
    try:
        time.sleep(1.0)
        noisy = decision(tmp_path / "noisy")
    finally:
        for process in hogs:
            process.kill()
            process.join(10)
    next_start = decision(tmp_path / "noisy")
    weights = [
        m.weight.detach().contiguous()
        for m in model.get_decoder().modules()
        if type(m) is torch.nn.Linear
    ]
    for chosen in (noisy, next_start):
        for rows in (1, 4, 8):
            ours, theirs = rows <= chosen, rows <= quiet_rows_chosen
            if ours == theirs:
                continue  # the same code runs the step
            ratios: list[float] = []
            # Five pairs, then ten more when their median is under the bound: where both ways
            # run at the same speed (fp32 on an AMX Xeon at 1-8 rows) five pairs ranged
            # 0.58-1.61 on a shared host and their median read 0.82 once; a way truly slower
            # stays under the bound however many pairs are taken.
            for pairs in (5, 10):
                for _ in range(pairs):  # interleaved: load from other work moves both alike
                    a = step_products_seconds(weights, rows, ours, kernels)
                    b = step_products_seconds(weights, rows, theirs, kernels)
                    ratios.append(b / a)  # speed of ours relative to the quiet start's
                if statistics.median(ratios) >= 0.85:
                    break
            assert statistics.median(ratios) >= 0.85, (rows, chosen, quiet_rows_chosen, ratios)
