"""``--device`` is explicit: an engine told cuda that finds no usable GPU exits 2 with one line
(the operator shows it in the pool's status), never falling back to the CPU (issue 27)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slotserve.engine.cli import device_problem

SLOTSERVE = Path(sys.executable).with_name("slotserve")


@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_an_engine_told_cuda_without_a_usable_gpu_exits_2_with_one_line(device: str):
    # No GPU is visible, whatever this machine has: the same outcome with or without one.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [str(SLOTSERVE), "engine", "--model", "smollm2", "--device", device],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"slotserve engine: cannot start: --device {device}: no usable GPU (")


def test_only_cuda_is_checked_before_loading():
    assert device_problem("cpu") is None and device_problem("auto") is None


def test_a_usable_gpu_passes():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    assert device_problem("cuda") is None
    assert device_problem(f"cuda:{torch.cuda.device_count()}") is not None
