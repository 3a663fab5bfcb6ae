"""`slotserve bench NAME`: the README's benchmark commands start, helpers imported from bench/."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slotserve import bench_cli


def test_every_runnable_benchmark_is_listed() -> None:
    names = bench_cli.available()
    assert {"engine_bench", "quant_bench", "step_cost", "prefix_bench"} <= set(names)
    # The shared library (bench/lib/, the package's __init__) holds no benchmark.
    assert not {"lib", "plots", "engine_plots", "__init__"} & set(names)


def test_a_benchmark_that_imports_its_neighbours_starts() -> None:
    # A fresh interpreter, as the command runs. quant_bench imports the most of bench.lib
    # (engines, step timing, quality).
    done = subprocess.run(
        [sys.executable, "-m", "slotserve.cli", "bench", "quant_bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_an_unknown_benchmark_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cli.main(["no_such_bench"]) == 2
    assert "unknown benchmark 'no_such_bench'" in capsys.readouterr().out
