"""Choices calibrated at load are cached per CPU kind, so every engine on a node chooses alike.

No timing is asserted: the measurement is replaced where a test needs a given answer, and the
tests check who measured, who read, and what was chosen. (What one busy start may decide:
test_engine_calibration_noise.py.)
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from slotserve.engine.core.model import linear, native_linear
from slotserve.engine.core.model.calibration import CalibrationCache, Measurement, cpu_identity
from slotserve.engine.core.model.linear import PackedLinear, onednn_supported
from slotserve.engine.core.model.native_linear import NativeLinear
from slotserve.engine.core.model.runner import ModelRunner
from tests.engine.engine_core_support import runner_on

CPU_A = {"cpu_model": "Test CPU A", "cpu_flags": "avx2 fma", "machine": "x86_64", "torch": "t"}
CPU_B = {**CPU_A, "cpu_flags": "avx2 avx512f fma"}
QUESTION = {"rows": 8, "shapes": [[64, 64]]}


class CountingMeasure:
    def __init__(self, choice: str = "onednn", delay: float = 0.0) -> None:
        self.choice = choice
        self.delay = delay
        self.calls = 0

    def __call__(self) -> Measurement:
        self.calls += 1
        time.sleep(self.delay)
        return Measurement(self.choice, {"aten_ms": 2.0, "onednn_ms": 1.0})


def test_a_second_load_reads_the_decision(tmp_path):
    measure = CountingMeasure("onednn")
    first = CalibrationCache(tmp_path, CPU_A).decide("linear_backend", QUESTION, measure)
    # Another engine, another moment: a measurement now would say aten; the cache says onednn.
    again = CountingMeasure("aten")
    second = CalibrationCache(tmp_path, CPU_A).decide("linear_backend", QUESTION, again)
    assert (first.source, first.choice) == ("measured", "onednn")
    assert (second.source, second.choice) == ("cached", "onednn")
    assert second.figures == {"aten_ms": 2.0, "onednn_ms": 1.0, "trials": 2.0}
    assert (measure.calls, again.calls) == (2, 0)  # two trials that agree, then none
    (stored,) = tmp_path.glob("linear_backend-*.json")
    assert json.loads(stored.read_text())["identity"] == CPU_A


@pytest.mark.parametrize(
    "other",
    [
        ("linear_backend", CPU_B, QUESTION),  # another CPU kind (flags)
        ("linear_backend", {**CPU_A, "torch": "u"}, QUESTION),  # another torch
        ("linear_backend", CPU_A, {**QUESTION, "rows": 32}),  # another question
        ("other_choice", CPU_A, QUESTION),
    ],
)
def test_a_different_key_measures_again(tmp_path, other):
    CalibrationCache(tmp_path, CPU_A).decide("linear_backend", QUESTION, CountingMeasure())
    name, identity, question = other
    measure = CountingMeasure("aten")
    record = CalibrationCache(tmp_path, identity).decide(name, question, measure)
    assert (record.source, record.choice, measure.calls) == ("measured", "aten", 2)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_engines_starting_together_measure_once_and_agree(tmp_path):
    measure = CountingMeasure("onednn", delay=0.3)
    records = []

    def load() -> None:
        cache = CalibrationCache(tmp_path, CPU_A)
        records.append(cache.decide("linear_backend", QUESTION, measure))

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert measure.calls == 2  # one engine's two trials
    assert sorted(r.source for r in records) == ["cached", "cached", "measured"]
    assert {r.choice for r in records} == {"onednn"}


def test_unreadable_or_unwritable_caches_cost_the_cache_not_the_start(tmp_path, caplog):
    CalibrationCache(tmp_path, CPU_A).decide("linear_backend", QUESTION, CountingMeasure())
    (stored,) = tmp_path.glob("*.json")
    stored.write_text("{not json")
    record = CalibrationCache(tmp_path, CPU_A).decide("linear_backend", QUESTION, CountingMeasure())
    assert record.source == "measured"
    assert "measuring again" in caplog.text
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    record = CalibrationCache(blocked / "sub", CPU_A).decide(
        "linear_backend", QUESTION, CountingMeasure("aten")
    )
    assert (record.source, record.choice) == ("measured", "aten")


def test_a_failed_measurement_is_not_cached(tmp_path):
    failing = lambda: Measurement("aten", cacheable=False)  # noqa: E731
    CalibrationCache(tmp_path, CPU_A).decide("linear_backend", QUESTION, failing)
    measure = CountingMeasure("onednn")
    record = CalibrationCache(tmp_path, CPU_A).decide("linear_backend", QUESTION, measure)
    assert (record.source, record.choice, measure.calls) == ("measured", "onednn", 2)


def test_cpu_identity_reads_model_and_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fma avx2 sse\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fma avx2 sse\n"
    )
    identity = cpu_identity(cpuinfo)
    assert identity["cpu_model"] == "AMD EPYC 7B13"
    assert identity["cpu_flags"] == "avx2 fma sse"
    assert identity["torch"] == torch.__version__


# -- the runner ------------------------------------------------------------------------------

needs_onednn = pytest.mark.skipif(
    not onednn_supported(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def runner(cache: CalibrationCache, use_native_kernels: bool = False) -> ModelRunner:
    # Without the native kernels, ``auto`` is the oneDNN-or-aten choice these tests are about.
    return runner_on(
        tiny_llama(),
        num_slots=4,
        max_model_len=64,
        calibration=cache,
        native_kernels=use_native_kernels,
    )


def is_packed(r: ModelRunner) -> bool:
    return isinstance(r.model.model.layers[0].self_attn.o_proj, PackedLinear)


@needs_onednn
def test_runners_follow_the_cached_decision_without_timing(tmp_path, monkeypatch):
    first = runner(CalibrationCache(tmp_path, CPU_A))
    (record,) = first.calibrations
    # "rule": the trials waited for a CPU (other work on this machine) and oneDNN's rule held.
    assert record.source in ("measured", "rule") and record.name == "linear_backend"
    assert is_packed(first) == (record.choice == "onednn")
    assert {"aten_ms", "onednn_ms", "onednn_over_aten"} <= set(record.figures)

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached decision must not be measured again")

    monkeypatch.setattr(linear, "measure_linear_backends", no_timing)
    for _ in range(2):
        later = runner(CalibrationCache(tmp_path, CPU_A))
        assert later.calibrations[0].source == "cached"
        assert later.calibrations[0].choice == record.choice
        assert is_packed(later) == is_packed(first)


@needs_onednn
@pytest.mark.parametrize("choice", ["onednn", "aten"])
def test_the_cached_choice_is_what_the_runner_does(tmp_path, monkeypatch, choice):
    monkeypatch.setattr(linear, "measure_linear_backends", lambda *a: Measurement(choice))
    runner(CalibrationCache(tmp_path, CPU_A))
    monkeypatch.setattr(linear, "measure_linear_backends", lambda *a: Measurement("neither"))
    later = runner(CalibrationCache(tmp_path, CPU_A))
    assert is_packed(later) == (choice == "onednn")
    # Another CPU kind measures for itself (here: "neither", which is not oneDNN).
    other = runner(CalibrationCache(tmp_path, CPU_B))
    assert other.calibrations[0].source == "measured"
    assert not is_packed(other)
    assert type(other.model.model.layers[0].self_attn.o_proj) is nn.Linear


def test_explicit_backends_calibrate_nothing(tmp_path):
    r = runner_on(
        tiny_llama(),
        num_slots=2,
        max_model_len=32,
        linear_backend="aten",
        calibration=CalibrationCache(tmp_path, CPU_A),
    )
    # Only the report of the kernels loaded (decode attention still runs on them).
    assert [c.name for c in r.calibrations] == ["native_kernels"]
    assert list(tmp_path.iterdir()) == []


def _start_engine_runner(home: str, barrier, results) -> None:
    """In a fresh process: build a runner as an engine's load does, on a shared home."""
    from pathlib import Path

    barrier.wait(60)  # all processes reach the calibration together, like the demo's engines
    r = runner(CalibrationCache(Path(home), CPU_A))
    (record,) = r.calibrations
    results.put((record.source, record.choice, is_packed(r)))


@needs_onednn
def test_engines_in_separate_processes_starting_together_agree(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(3), context.Queue()
    processes = [
        context.Process(target=_start_engine_runner, args=(str(tmp_path), barrier, results))
        for _ in range(3)
    ]
    for process in processes:
        process.start()
    try:
        outcomes = sorted(results.get(timeout=240) for _ in processes)
    finally:
        for process in processes:
            process.join(30)
    # The first decides (from trials, or the rule if they waited for a CPU), the others read.
    assert [source for source, _, _ in outcomes][:2] == ["cached", "cached"]
    assert outcomes[2][0] in ("measured", "rule")
    assert len({(choice, packed) for _, choice, packed in outcomes}) == 1


@pytest.mark.parametrize("rows", [0, 2])
def test_the_native_row_count_is_measured_once_and_followed(tmp_path, monkeypatch, rows):
    monkeypatch.setattr(native_linear, "measure_native_rows", lambda *a: Measurement(str(rows)))
    first = runner(CalibrationCache(tmp_path, CPU_A), use_native_kernels=True)
    monkeypatch.setattr(native_linear, "measure_native_rows", lambda *a: Measurement("4"))
    later = runner(CalibrationCache(tmp_path, CPU_A), use_native_kernels=True)
    for r, source in ((first, "measured"), (later, "cached")):
        assert (r.calibrations[0].name, r.calibrations[0].source) == ("native_rows", source)
        o_proj = r.model.model.layers[0].self_attn.o_proj
        if rows:
            assert isinstance(o_proj, NativeLinear) and o_proj.max_native_rows == rows
            assert [c.name for c in r.calibrations] == ["native_rows", "native_kernels"]
        else:  # native never won: the oneDNN-or-aten choice follows
            assert not isinstance(o_proj, NativeLinear)
            names = [c.name for c in r.calibrations]
            assert names == ["native_rows", "linear_backend", "native_kernels"]
        assert r.native is not None
        assert r.calibrations[-1].choice == r.native.isa  # which instruction set runs


@pytest.mark.parametrize(("native_decode", "margin"), [(True, 1.10), (False, 0.95)])
def test_native_rows_allow_slower_products_where_the_whole_step_runs_natively(
    tmp_path, monkeypatch, native_decode, margin
):
    """With the native decode step, native products up to 10% slower than aten's still win
    (the step drops the work around them); without it, native must be 5% faster."""
    asked: list[float] = []

    def measure(kernels, linears, max_rows, given_margin):
        asked.append(given_margin)
        return Measurement("4")

    monkeypatch.setattr(native_linear, "measure_native_rows", measure)
    r = runner_on(
        tiny_llama(),
        num_slots=4,
        max_model_len=64,
        calibration=CalibrationCache(tmp_path, CPU_A),
        native_decode=native_decode,
    )
    assert asked == [margin] * 2  # two agreeing trials
    assert (r.native_step is not None) == native_decode
