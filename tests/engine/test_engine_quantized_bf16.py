"""Quantized prefill on the bf16 units (issue 24, item 2): an int8 or int4 model's prefill
products take their rows in bf16 and widen the weights to bf16 a task at a time
(``kernels/quantized_bf16.c``), wherever the kernels run AVX512_BF16; the plain C version is the
reference on every CPU. The widened weights are the bits ``pack_bf16`` gives the dequantized
weights, so a quantized model's prefill step equals, to the bit, the bf16 step of a model whose
fp32 weights are the dequantized ones."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slotserve.engine.core.kernels import ISAS, NativeKernels, load_kernels, pack_bf16
from slotserve.engine.core.model import bf16_prefill
from slotserve.models.tiny import TOKENIZER_FILES
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import make_engine, model_runner, step_hidden


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


@pytest.fixture(params=["plain_c", "avx512_bf16"])
def isa(request, kernels: NativeKernels) -> Iterator[str]:
    if request.param not in kernels.supported_isas:
        pytest.skip(f"this CPU cannot run {request.param}")
    kernels.set_isa(request.param)
    try:
        yield request.param
    finally:
        kernels.set_isa(ISAS[-1])


def quantized(kernels: NativeKernels, weight: torch.Tensor, fmt: str):
    """(q, scale, minimum or None) and the dequantized fp32 weight."""
    if fmt == "int8":
        q, scale = kernels.quantize_q8(weight)
        return (q, scale, None), kernels.dequantize_q8(q, scale)
    q, scale, minimum = kernels.quantize_q4(weight)
    return (q, scale, minimum), kernels.dequantize_q4(q, scale, minimum)


# (rows, channels, k): one row; a channel count under one task and not a multiple of 16; k at
# the group size; a partial last task; SmolLM2's q/k/v at a chunk's width.
SHAPES = [(1, 17, 32), (7, 50, 96), (33, 48, 64), (40, 100, 128), (130, 960, 576)]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_rows_and_the_widened_weights_multiply_as_their_bf16_roundings(
    kernels, isa, fmt, shape
):
    m, n, k = shape
    torch.manual_seed(m * n + k)
    x = torch.randn(m, k)
    tensors, dense = quantized(kernels, torch.randn(n, k) * 0.2, fmt)
    got = kernels.gemm_quantized_bf16(x, *tensors)
    # Every product of two bf16 values is exact in fp64; only the fp32 sums' order differs.
    reference = x.bfloat16().double() @ dense.bfloat16().double().T
    scale = reference.abs().max().item()
    assert got.shape == (m, n)
    assert (got.double() - reference).abs().max().item() <= 2e-6 * scale * k**0.5
    if isa == "avx512_bf16":
        # The same bits as the packed bf16 product of the dequantized weights: the widening
        # packs what pack_bf16 packs, and the tiles are gemm_bf16's.
        assert torch.equal(got, kernels.gemm_bf16(x, pack_bf16(dense), n))


def test_tensors_that_are_not_quantize_outputs_are_refused(kernels):
    x = torch.randn(4, 64)
    (q, scale, minimum), _ = quantized(kernels, torch.randn(16, 64), "int4")
    # No rows: an empty result, as gemm_q4 gives (not an allocation error).
    assert kernels.gemm_quantized_bf16(torch.zeros(0, 64), q, scale, minimum).shape == (0, 16)
    with pytest.raises(ValueError, match="gemm_quantized_bf16"):
        kernels.gemm_quantized_bf16(x, q.view(torch.int8), scale, minimum)  # int4 bytes as int8
    with pytest.raises(ValueError, match="gemm_quantized_bf16"):
        kernels.gemm_quantized_bf16(x, q, scale[:, :1], minimum)
    with pytest.raises(ValueError, match="gemm_quantized_bf16"):
        kernels.gemm_quantized_bf16(torch.randn(4, 48), q[:, :24], scale[:, :1], minimum[:, :1])


def dequantized_copy(kernels: NativeKernels, model_dir: Path, dest: Path, fmt: str) -> Path:
    """``model_dir``'s model with every decoder linear's weight replaced by its ``fmt``
    round trip (what the quantized engine multiplies), saved to ``dest``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for module in model.get_decoder().layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantized(kernels, module.weight, fmt)[1])
    model.save_pretrained(str(dest), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            (dest / name).write_bytes((model_dir / name).read_bytes())
    return dest


def test_int4_steps_equal_the_bf16_steps_on_the_dequantized_weights(
    kernels, tiny_model_dir, tmp_path, caplog
):
    if kernels.isa != "avx512_bf16":
        pytest.skip("the kernels multiply no bf16 on this CPU")
    reference_dir = dequantized_copy(kernels, tiny_model_dir, tmp_path / "dequantized", "int4")
    with caplog.at_level(logging.INFO):
        engine = make_engine(
            tiny_model_dir,
            quantization="int4",
            prefill_dtype="auto",
            decode_dtype="auto",
            max_batch_size=12,
        )
    runner = model_runner(engine)
    assert runner.prefill_bf16 and runner.decode_bf16 and runner.native_step is not None
    assert runner.native_step.quantized_bf16 and runner.native_step.prefill
    assert "decoder's int4 weights widened to bf16 as they are multiplied, no copy" in caplog.text
    assert "decode products in bfloat16 in steps of 12 rows or more" in caplog.text
    # No layer holds a bf16 copy: the point of quantizing is the memory.
    assert all(
        layer.weight_bf16 is None and layer.weight_packed is None
        for layer in bf16_prefill.decoder_linears(runner.model)
    )
    dense = make_engine(
        reference_dir,
        prefill_dtype="bfloat16",
        decode_dtype="bfloat16",
        linear_backend="native",
        max_batch_size=12,
    )
    # A 40-row prefill chunk, and a decode step of 12 rows: every product takes the bf16 rows
    # (12 and up, llama_step.c's QUANTIZED_BF16_ROWS), to the bit what the packed bf16 weights
    # give on VDPBF16PS (quantized weights never go to the AMX tiles, which sum in another
    # order: off for the reference).
    for rows, decode in ((40, False), (12, True)):
        bf16 = step_hidden(engine, rows, True, decode=decode)
        amx = kernels.amx
        kernels.set_amx(False)
        try:
            reference = step_hidden(dense, rows, True, decode=decode)
        finally:
            kernels.set_amx(amx)
        assert torch.equal(bf16, reference), (rows, decode)
        # With the gate off (a prompt being scored) the same rows multiply in fp32: they differ,
        # by bf16's rounding and no more.
        fp32 = step_hidden(engine, rows, False, decode=decode)
        assert not torch.equal(bf16, fp32)
        torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.05)
    # Under 12 rows the weights stream through the fp32 panels, gate or not.
    assert torch.equal(
        step_hidden(engine, 11, True, decode=True), step_hidden(engine, 11, False, decode=True)
    )


def test_where_the_kernels_multiply_no_bf16_a_quantized_model_stays_fp32(
    kernels, tiny_model_dir, monkeypatch, caplog
):
    identity = bf16_prefill.cpu_identity()
    monkeypatch.setattr(
        bf16_prefill, "cpu_identity", lambda: {**identity, "cpu_flags": "avx2 fma avx512_bf16"}
    )
    kernels.set_isa("avx512")  # the widest below AVX512_BF16 this CPU has
    try:
        with caplog.at_level(logging.INFO):
            auto = make_engine(
                tiny_model_dir, quantization="int4", prefill_dtype="auto", decode_dtype="auto"
            )
            asked = make_engine(
                tiny_model_dir,
                quantization="int8",
                prefill_dtype="bfloat16",
                decode_dtype="bfloat16",
            )
    finally:
        kernels.set_isa(ISAS[-1])
    for engine in (auto, asked):
        runner = model_runner(engine)
        assert not runner.prefill_bf16 and not runner.decode_bf16
        assert runner.native_step is not None and not runner.native_step.quantized_bf16
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings  # only the explicit bfloat16s warn, once each
    assert any("needs the decoder's linear layers on the native kernels" in w for w in warnings)
    assert any(
        "decode_dtype bfloat16 needs the native kernels on a CPU with" in w for w in warnings
    )
