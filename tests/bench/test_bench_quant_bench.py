"""bench/quant_bench.py end to end on a tiny model: speed and quality in one JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench import quant_bench


def run_bench(model_dir: Path, tmp_path: Path, *modes: str, batches: str = "1 2") -> dict:
    peer = tmp_path / "llamacpp.json"
    peer.write_text(json.dumps({"tokens_per_s": {"batch_1": 50.0, "batch_8": None}}))
    out = tmp_path / "quant.json"
    argv = ["--model", str(model_dir), "--quick", "--batches", *batches.split()]
    argv += ["--decode-tokens", "3"]
    argv += ["--quality-tokens", "600", "--window", "256", "--threads", "1"]
    argv += ["--llama-cpp", str(peer), "--out", str(out), "--quantization", *modes]
    assert quant_bench.main(argv) == 0
    return json.loads(out.read_text())


def test_unquantized_run_reports_speed_against_hf_and_llama_cpp(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    report = run_bench(tiny_model_dir, tmp_path, "none", batches="1 4")
    assert [row["batch"] for row in report["decode"]] == [1, 4]
    first, second = report["decode"]
    assert first["none_tok_s"] > 0 and first["hf_generate_fp32_tok_s"] > 0
    assert first["none_vs_hf"] == first["none_tok_s"] / first["hf_generate_fp32_tok_s"]
    assert first["none_vs_llama_cpp"] == first["none_tok_s"] / 50.0
    assert second["llama_cpp_tok_s"] is None and second["none_vs_llama_cpp"] is None
    (model,) = report["models"]
    assert model["mode"] == "none" and model["quality"] is None
    assert model["quantized_bytes_after"] is None
    assert model["weight_bytes"] > 0
    assert report["quality_tokens"] == 600
    # fp32's targets at the batch sizes run (none at 32); the step ratio from interleaved steps.
    targets = {target["target"]: target for target in report["targets"]}
    assert set(targets) == {
        "none batch 1 ≥ 2x HF generate() fp32",
        "none step at batch 4 ≤ 1.15x the step at batch 1",
    }
    step_ms = {int(batch): ms for batch, ms in report["fp32_step_ms_interleaved"].items()}
    assert targets["none step at batch 4 ≤ 1.15x the step at batch 1"]["ratio"] == (
        step_ms[4] / step_ms[1]
    )


def test_quantized_runs_report_quality_and_the_issues_targets(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    report = run_bench(tiny_model_dir, tmp_path, "int8", "int4")
    models = {model["mode"]: model for model in report["models"]}
    assert set(models) == {"int8", "int4"}
    for mode, model in models.items():
        quality = model["quality"]
        assert quality["num_predictions"] == 600 - 3  # windows of 256, 256, 88
        assert 0.5 < quality["top1_agreement"] <= 1.0
        assert abs(quality["perplexity_increase"]) < 1.0
        assert model["quantized_bytes_after"] < model["quantized_bytes_before"]
        assert report["decode"][0][f"{mode}_tok_s"] > 0
    targets = {target["target"]: target for target in report["targets"]}
    assert (
        targets["int8 batch 1 ≥ 4x HF generate() fp32"]["ratio"]
        == (report["decode"][0]["int8_vs_hf"])
    )
    assert targets["int4 batch 1 ≥ 1x llama.cpp"]["pass"] == (
        report["decode"][0]["int4_tok_s"] >= 50.0
    )
    assert {"int8 quality", "int4 quality"} <= set(targets)


def test_the_llama_cpp_reader_takes_batch_sizes_only(tmp_path):
    peer = tmp_path / "peer.json"
    rates = {"batch_1": 77.3, "batch_1_batch_api": 54.6, "batch_8": 86.5, "batch_32": None}
    peer.write_text(json.dumps({"tokens_per_s": rates}))
    assert quant_bench.read_llama_cpp(peer) == {1: 77.3, 8: 86.5}
