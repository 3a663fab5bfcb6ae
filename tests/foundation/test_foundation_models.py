"""The demo model pull, model resolution, tiny models and `slotserve generate`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slotserve.models.pull import COMPLETE_MARKER, ModelPullError, pull_model
from slotserve.models.resolve import ModelNotFoundError, resolve_model
from slotserve.models.tiny import build_tiny_model

BIN = Path(sys.executable).parent


def test_pulled_smollm2_is_a_plain_hugging_face_folder(smollm2_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", COMPLETE_MARKER):
        assert (smollm2_dir / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tokenizer.chat_template, "the chat template must survive the conversion"


def test_second_pull_is_a_noop(smollm2_dir: Path, slotserve_home: Path) -> None:
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    proc = subprocess.run(
        [str(BIN / "slotserve"), "model", "pull", "smollm2", "--home", str(slotserve_home)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert proc.stdout.strip() == str(smollm2_dir)
    assert time.monotonic() - started < 30
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_unknown_model_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelPullError, match="unknown model 'gpt-5'"):
        pull_model("gpt-5", home=tmp_path)


def test_resolve_accepts_local_folders_and_rejects_bad_sources(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    assert resolve_model(str(tiny_model_dir)) == str(tiny_model_dir.resolve())
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="not a known name"):
        resolve_model(str(tmp_path / "missing"))


def test_tiny_model_is_deterministic_and_small(tmp_path: Path, smollm2_dir: Path) -> None:
    first = build_tiny_model(tmp_path / "a", tokenizer_dir=smollm2_dir, seed=3)
    second = build_tiny_model(tmp_path / "b", tokenizer_dir=smollm2_dir, seed=3)
    outputs = []
    for folder in (first, second):
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
        ids = torch.tensor([[1, 2, 3, 4]])
        # transformers types from_pretrained's result as a class that does not match
        # generate's own self-type protocol, though the loaded model is both.
        generated = model.generate(ids, max_new_tokens=8, do_sample=False)  # type: ignore[misc]
        outputs.append(generated[0].tolist())
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_generate_answers_with_the_real_model(smollm2_dir: Path, slotserve_home: Path) -> None:
    proc = subprocess.run(
        [str(BIN / "slotserve"), "generate", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=180,
        env={"SLOTSERVE_HOME": str(slotserve_home), "PATH": str(BIN)},
        check=True,
    )
    assert "Paris" in proc.stdout


def test_generate_rejects_bad_flags() -> None:
    proc = subprocess.run(
        [str(BIN / "slotserve"), "generate", "hi", "--temperature", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "temperature" in proc.stderr


def test_the_conversion_parses_a_gguf_once_and_puts_gguf_back(tmp_path: Path) -> None:
    """transformers opens the GGUF three times while converting: one parse serves them all,
    and gguf's own functions are back afterwards (the pull's files are the same bytes: checked
    by hand, see _gguf_parsed_once)."""
    import gguf
    import numpy as np

    from slotserve.models.pull import _gguf_parsed_once

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    originals = (gguf.GGUFReader, gguf.get_tensor_name_map)
    with _gguf_parsed_once():
        first, second = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is second and first.tensors[0].name == "token_embd.weight"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 3)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == originals
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
