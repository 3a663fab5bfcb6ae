"""bench/gpu_check.sh and bench/gpu_decode_bench.py: the CPU dry run and the ways they refuse.

The GPU itself is lent only by chance; these keep the script runnable for the day it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def run_check(tmp_path: Path, *args: str, python: str = sys.executable):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": python}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,  # the script finds the repository from its own path
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_dry_run_writes_the_table_and_json(tmp_path: Path) -> None:
    proc = run_check(tmp_path, "--dry-run", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ours/bound" in proc.stdout
    assert "gpu_check: done" in proc.stdout
    assert "ours/bound" in (tmp_path / "gpu_check.log").read_text()
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    assert report["device"] == "cpu"
    assert report["copy_bandwidth_bytes_s"] > 0
    assert (report["prompt_tokens"], report["new_tokens"], report["repeats"]) == (16, 8, 1)
    assert report["hf_cache"] == "dynamic"
    [model] = report["models"]
    assert model["name"] == "tiny"
    # fp32: 4 bytes a parameter; a step reads all but the input embedding (512 x 64).
    assert model["weight_bytes"] == 4 * model["params"]
    assert model["step_weight_bytes"] == model["weight_bytes"] - 4 * 512 * 64
    assert model["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # k+v, layers, kv heads, head dim
    assert [row["batch"] for row in model["rows"]] == [1, 2]
    for row in model["rows"]:
        assert "hf_error" not in row and "ours_error" not in row, row
        assert row["ours_tok_s"] > 0 and row["hf_generate_tok_s"] > 0
        # Graphs on and off (eager on a CPU), each with overlapped steps and without: overlap
        # changes when a token is read, never which.
        assert row["ours_nooverlap_tok_s"] > 0 and row["ours_nographs_overlap_tok_s"] > 0
        assert row["ours_chained_steps"] > 0 and row["ours_nographs_overlap_chained_steps"] > 0
        assert row["ours_tokens_equal_plain"] and row["ours_nographs_overlap_tokens_equal_plain"]
        assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["hf_generate_tok_s"])
        assert row["ours_ms_per_step"] == pytest.approx(1e3 * row["batch"] / row["ours_tok_s"])
        assert row["bound_tok_s"] > 0
        assert row["ours_fraction_of_bound"] == pytest.approx(
            row["ours_tok_s"] / row["bound_tok_s"]
        )
        assert "bound_nominal_tok_s" not in row  # the H200's datasheet figure is for CUDA only


def test_without_cuda_it_says_so_and_exits_2(tmp_path: Path, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from bench.gpu_decode_bench import main

    assert main(["--out", str(tmp_path / "x.json")]) == 2
    assert "gpu_decode_bench: no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "x.json").exists()


def test_a_python_without_torch_is_refused_with_one_line(tmp_path: Path) -> None:
    proc = run_check(tmp_path, python="false")
    assert proc.returncode == 2
    assert "gpu_check: false cannot import torch" in proc.stdout
    assert not (tmp_path / "gpu_check.json").exists()
