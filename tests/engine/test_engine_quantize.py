"""Quantized engines: the same tokens where the weights are exact on the grid, SmolLM2 still
answering, and settings that cannot run stopping the engine at start-up with exit 2."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from slotserve.engine.core.kernels import load_kernels
from slotserve.engine.core.model.loader import find_kernels
from slotserve.engine.core.model.native_linear import QUANTIZED_MAX_ROWS, NativeLinear
from slotserve.engine.core.model.quantize import QuantizationUnsupported, native_layers
from slotserve.engine.core.params import SamplingParams
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    make_engine,
    model_runner,
    run_staggered,
)
from tests.engine.engine_server_support import SLOTSERVE
from tests.engine.test_engine_kernels import assert_int4_close, dequantize_q4, dequantize_q8


def snap_to_grid(model_dir: Path, dest: Path, mode: str) -> Path:
    """A copy of the model whose linear weights lie on ``mode``'s grid (the output layer on
    int8's), as a GGUF-converted model's do: quantizing it loses nothing."""
    from transformers import AutoModelForCausalLM

    if (dest / "config.json").is_file():
        return dest
    kernels = load_kernels(CommonSettings().home)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                if mode == "int4" and name != "lm_head":
                    module.weight.copy_(dequantize_q4(*kernels.quantize_q4(module.weight)))
                else:
                    module.weight.copy_(dequantize_q8(*kernels.quantize_q8(module.weight)))
    model.save_pretrained(str(dest))
    for tokenizer_file in model_dir.iterdir():
        if tokenizer_file.name.startswith("tokenizer") or tokenizer_file.suffix == ".jinja":
            (dest / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    return dest


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(5000, 49_000, (n,), generator=generator).tolist() for n in (5, 40, 90)]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weights_on_the_grid_give_the_tokens_of_the_float_engine(sharp_dir, tmp_path_factory, mode):
    snapped = snap_to_grid(sharp_dir, tmp_path_factory.getbasetemp() / f"sharp-{mode}", mode)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for quantization in ("none", mode):
        engine = make_engine(snapped, max_batch_size=3, quantization=quantization)
        seqs = run_staggered(engine, prompts(), params, every=2, per=1)
        outputs[quantization] = [seq.generated_token_ids for seq in seqs]
        if quantization != "none":
            layers = native_layers(model_runner(engine).model)
            # 2 layers x (q/k/v fused, o, gate/up fused, down) + the output layer (int8).
            assert len(layers) == 9
            assert {m.format for m in layers} == {mode, "int8"}
            names = {record.name for record in engine.stats().calibrations}
            assert {"native_kernels", "quantization"} <= names
    assert outputs[mode] == outputs["none"]


def test_many_rows_take_the_dequantized_path_with_the_same_result(sharp_dir):
    kernels = load_kernels(CommonSettings().home)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    layer = NativeLinear(kernels, weight, torch.randn(64), "int4")
    x = torch.randn(QUANTIZED_MAX_ROWS + 5, 128)
    dense = layer(x)  # above QUANTIZED_MAX_ROWS: dequantize + torch
    for i in range(x.shape[0]):  # native, one row each (the row rounded to 16 bits, bounded)
        row = x[i : i + 1]
        assert_int4_close(layer(row), row, layer.q, layer.scale, dense[i : i + 1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_smollm2_still_answers(smollm2_dir, mode):
    engine = make_engine(smollm2_dir, max_batch_size=2, quantization=mode, num_threads=None)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prompt = list(engine.tokenizer.encode(text, add_special_tokens=False))
    result = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert result.text == "The capital of France is Paris."


def test_preflight_refuses_what_cannot_run(tmp_path):
    # Before the model loads: the loader's one kernel lookup refuses the quantization first.
    with pytest.raises(QuantizationUnsupported, match="CPU only"):
        find_kernels(torch.device("cuda"), torch.float32, tmp_path, quantization="int8")
    with pytest.raises(QuantizationUnsupported, match="float32"):
        find_kernels(torch.device("cpu"), torch.bfloat16, tmp_path, quantization="int4")
    assert find_kernels(torch.device("cuda"), torch.bfloat16, tmp_path) is None


# An engine process on a machine without a trusted compiler and without a prebuilt library
# ($CC no longer names the compiler, so the test takes the system's away in the process itself).
NO_COMPILER = (
    "import sys; from pathlib import Path; import slotserve.engine.core.kernels.library as lib; "
    "lib.COMPILER_FOLDERS = (); lib.PREBUILT = Path('/nonexistent'); "
    "from slotserve.cli import main; sys.argv[0] = 'slotserve'; sys.exit(main())"
)


def run_engine(
    args: list[str], env: dict[str, str], no_compiler: bool = False
) -> subprocess.CompletedProcess[str]:
    command = [str(SLOTSERVE)]
    if no_compiler:
        command = [str(SLOTSERVE.with_name("python")), "-c", NO_COMPILER]
    return subprocess.run(
        [*command, "engine", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize(
    "args,no_compiler,message",
    [
        (["--dtype", "bfloat16"], False, "quantizes from float32 weights"),
        ([], True, "need a C compiler"),
    ],
    ids=["bfloat16", "no-compiler"],
)
def test_an_engine_that_cannot_quantize_exits_2_with_one_line(
    tiny_model_dir, tmp_path, args, no_compiler, message
):
    done = run_engine(
        ["--model", str(tiny_model_dir), "--quantization", "int8", *args],
        {"SLOTSERVE_HOME": str(tmp_path)},  # no cached library hides the missing compiler
        no_compiler,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
