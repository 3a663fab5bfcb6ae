"""Decode products in bfloat16 (issue 24, item 2): the native bf16 products (VDPBF16PS where the
CPU has AVX512_BF16, bf16 widened to fp32 on every narrower instruction set) against a float64
reference on every instruction set the machine runs; with ``decode_dtype bfloat16`` the native
step and the layers' own path multiply decode rows on bf16 copies of the weights, the output
projection too, while a step that scores its prompt stays fp32; ``auto`` takes bf16 only where
the kernels run AVX512_BF16, and an explicit ``bfloat16`` that cannot run warns and stays fp32
(quantized models: test_engine_quantized_bf16.py).
"""

from __future__ import annotations

import logging

import pytest
import torch

from slotserve.engine.core.kernels import ISAS, NativeKernels, load_kernels, pack_bf16
from slotserve.engine.core.model import bf16_decode
from slotserve.engine.core.model.bf16_prefill import decoder_linears
from slotserve.engine.core.model.native_linear import NativeLinear
from slotserve.engine.core.params import SamplingParams
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import make_engine, model_runner
from tests.engine.test_engine_bf16_prefill import SENTENCES, first_token_logprobs


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


@pytest.fixture
def bf16_kernels(kernels: NativeKernels):
    if "avx512_bf16" not in kernels.supported_isas:
        pytest.skip("this CPU has no AVX512_BF16")
    yield kernels
    kernels.set_isa(ISAS[-1])


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The products of x rounded to bf16 and the bf16 weights, summed in float64."""
    return (x.to(torch.bfloat16).double() @ weight.double().T).float()


def test_packing_lays_each_column_pair_of_16_channels_side_by_side():
    weight = torch.arange(20 * 6, dtype=torch.float32).view(20, 6)  # exact in bf16
    packed = pack_bf16(weight)
    assert packed.shape == (2, 3, 16, 2) and packed.dtype == torch.bfloat16
    for c in range(32):
        for j in range(6):
            expected = weight[c, j] if c < 20 else 0.0  # the last block padded with zeros
            assert packed[c // 16, j // 2, c % 16, j % 2] == expected
    with pytest.raises(ValueError, match="even K"):
        pack_bf16(torch.zeros(4, 5))


@pytest.mark.parametrize(
    "m,k,n",
    [(1, 576, 96), (3, 576, 64), (4, 1536, 40), (5, 64, 9), (17, 96, 130), (64, 128, 68),
     (100, 64, 33), (2, 40, 6), (300, 34, 50), (9, 2, 16), (16, 576, 960), (33, 64, 48),
     (47, 1536, 576), (64, 96, 16)],
)  # fmt: skip
def test_bf16_products_match_the_reference_on_every_instruction_set(kernels, m, k, n):
    """Every instruction set this CPU runs, and the AMX tiles (gemm_amx.c: 16 rows or more, k a
    multiple of 32, n of 16) where it has them."""
    torch.manual_seed(m * 1000 + n)
    x = torch.randn(m, k)
    weight = torch.randn(n, k).to(torch.bfloat16)
    packed = pack_bf16(weight)
    expected = reference(x, weight)
    scale = expected.abs().max().item()
    units = [(isa, False) for isa in kernels.supported_isas]
    if kernels.set_amx(True):
        units.append((kernels.isa, True))
    try:
        for isa, amx in units:
            assert kernels.set_isa(isa) == isa
            assert kernels.set_amx(amx) == amx
            got = kernels.gemm_bf16(x, packed, n)
            # Exact products, fp32 sums in another order: a few ulps of the largest output.
            error = (got - expected).abs().max().item()
            assert error <= 2e-6 * scale * max(1, k / 64) ** 0.5, (isa, amx)
    finally:
        kernels.set_isa(ISAS[-1])
        kernels.set_amx(True)


def test_bf16_products_round_rows_to_nearest_even_and_keep_nan_and_inf(kernels):
    packed = pack_bf16(torch.ones(4, 32))
    # 1 + 2^-8 is a tie between two bf16 values: nearest even rounds it down to 1.
    x = torch.zeros(3, 32)
    x[0, 0] = 1.0 + 2.0**-8
    x[1, 0] = float("inf")
    x[2, 0] = float("nan")
    try:
        for isa in kernels.supported_isas:
            kernels.set_isa(isa)
            out = kernels.gemm_bf16(x, packed, 4)
            assert torch.equal(out[0], torch.ones(4)), isa
            assert torch.isinf(out[1]).all() and torch.isnan(out[2]).all(), isa
    finally:
        kernels.set_isa(ISAS[-1])


def test_bf16_products_refuse_weights_they_cannot_read(kernels):
    x = torch.randn(2, 64)
    packed = pack_bf16(torch.randn(8, 64))
    with pytest.raises(ValueError, match="packed bf16 weights"):
        kernels.gemm_bf16(x, packed.float(), 8)
    with pytest.raises(ValueError, match="packed bf16 weights"):
        kernels.gemm_bf16(x, pack_bf16(torch.randn(8, 32)), 8)  # rows of 64, weights of 32
    with pytest.raises(ValueError, match="packed bf16 weights"):
        kernels.gemm_bf16(x, packed, 17)  # 17 channels need two blocks
    with pytest.raises(ValueError, match="packed bf16 weights"):
        kernels.gemm_bf16(x, packed.transpose(0, 1), 8)


@pytest.mark.parametrize("m", [1, 32, 300])
def test_bf16_products_allocate_nothing_once_the_workspace_has_grown(kernels, m):
    packed = pack_bf16(torch.randn(96, 576))
    x = torch.randn(m, 576)
    first = kernels.gemm_bf16(x, packed, 96)
    before = kernels.fallback_allocations()
    for _ in range(10):
        kernels.gemm_bf16(x, packed, 96)
    assert kernels.fallback_allocations() == before
    torch.testing.assert_close(kernels.gemm_bf16(x, packed, 96), first)


def bf16_layers(engine) -> list[NativeLinear]:
    runner = model_runner(engine)
    layers = decoder_linears(runner.model)
    logits = runner.logits
    return layers + ([logits] if isinstance(logits, NativeLinear) else [])


def test_decode_rows_and_logits_multiply_in_bf16_and_a_scored_prompt_stays_fp32(
    tiny_model_dir, bf16_kernels
):
    engines = {
        dtype: make_engine(
            tiny_model_dir, decode_dtype=dtype, prefill_dtype="float32", max_batch_size=3
        )
        for dtype in ("float32", "bfloat16")
    }
    runner = model_runner(engines["bfloat16"])
    assert runner.decode_bf16 and not runner.prefill_bf16
    layers = bf16_layers(engines["bfloat16"])
    assert len(layers) == 4 * 2 + 1  # q/k/v (fused), o, gate/up, down of both layers; logits
    assert all(layer.weight_packed is not None for layer in layers)
    assert all(layer.weight_bf16 is None for layer in layers)  # no plain copy: no oneDNN
    assert not model_runner(engines["float32"]).decode_bf16
    assert all(layer.weight_packed is None for layer in bf16_layers(engines["float32"]))
    record = {r.name: r for r in runner.calibrations}["native_rows"]
    assert (record.source, record.choice) == ("rule", "3")  # nothing measured: the rule's rows

    # The layer's own path (a step the native step does not take) on its bf16 weight.
    layer = layers[0]
    assert layer.weight_fp32 is not None
    rows = torch.randn(2, layer.in_features)
    expected = reference(rows, layer.weight_fp32.to(torch.bfloat16))
    if layer.bias is not None:
        expected += layer.bias
    gate = runner.bf16_gate
    assert gate is not None and gate is layer.bf16_gate
    gate.on = True
    torch.testing.assert_close(layer(rows), expected, rtol=1e-5, atol=1e-5)
    gate.on = False  # as in a step that scores its prompt: fp32
    assert layer.weight_fp32 is not None
    fp32 = (rows.double() @ layer.weight_fp32.double().T).float()
    torch.testing.assert_close(layer(rows), fp32 + (layer.bias or 0), rtol=1e-5, atol=1e-5)

    prompts = [[(i * 31 + 7 * j) % 4000 + 50 for i in range(12 + j)] for j in range(3)]
    figures = {
        dtype: first_token_logprobs(engine, prompts, position=1)
        for dtype, engine in engines.items()
    }
    assert figures["bfloat16"] != figures["float32"]  # bf16 did run in the decode step
    for ours, theirs in zip(figures["bfloat16"], figures["float32"], strict=True):
        for token in ours.keys() & theirs.keys():
            assert ours[token] == pytest.approx(theirs[token], abs=0.05)

    scored = {}
    for dtype, engine in engines.items():
        scoring = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
        seq = engine.add_request(f"score-{dtype}", prompts[0], scoring)
        while engine.has_unfinished():
            engine.step()
        assert seq.prompt_logprobs is not None
        scored[dtype] = [entry.logprob for entry in seq.prompt_logprobs[1:] if entry is not None]
    assert scored["bfloat16"] == pytest.approx(scored["float32"], abs=1e-4)


def test_native_step_and_layers_agree_on_bf16_decode(tiny_model_dir, bf16_kernels):
    """The native step's bf16 decode and the layers' own path (transformers' modules over
    the same bf16 products) compute the same decode step."""
    prompts = [[(i * 13 + 5 * j) % 4000 + 50 for i in range(9 + j)] for j in range(3)]
    figures = []
    for native in (True, False):
        engine = make_engine(tiny_model_dir, decode_dtype="bfloat16", max_batch_size=3)
        runner = model_runner(engine)
        if not native:
            runner.native_step = None
        figures.append(first_token_logprobs(engine, prompts, position=1))
    for ours, theirs in zip(*figures, strict=True):
        assert ours.keys() == theirs.keys()
        for token, logprob in ours.items():
            assert logprob == pytest.approx(theirs[token], abs=1e-4)


def test_auto_takes_bf16_only_where_the_kernels_run_it(tiny_model_dir, kernels, caplog):
    try:
        kernels.set_isa("avx512")  # the widest below AVX512_BF16 this CPU has
        with caplog.at_level(logging.INFO, logger=bf16_decode.__name__):
            engine = make_engine(tiny_model_dir, decode_dtype="auto")
        # No bf16 copies (auto may take int16 there, on a CPU without bf16 units:
        # int16_products.py).
        assert all(layer.weight_packed is None for layer in bf16_layers(engine))
        warned = [r for r in caplog.records if r.name == bf16_decode.__name__ and r.levelno >= 30]
        assert not warned  # auto is silent
        with caplog.at_level(logging.WARNING, logger=bf16_decode.__name__):
            engine = make_engine(tiny_model_dir, decode_dtype="bfloat16")
        assert not model_runner(engine).decode_bf16
        assert all(layer.weight_packed is None for layer in bf16_layers(engine))
        assert "decode_dtype bfloat16 needs the native kernels on a CPU with AVX512_BF16" in (
            caplog.text
        )
    finally:
        kernels.set_isa(ISAS[-1])
    if "avx512_bf16" in kernels.supported_isas:
        assert model_runner(make_engine(tiny_model_dir, decode_dtype="auto")).decode_bf16


def test_the_engine_default_is_auto():
    from slotserve.engine.settings import EngineSettings

    assert EngineSettings.model_fields["decode_dtype"].default == "auto"


@pytest.mark.slow
def test_smollm2_under_bf16_decode_keeps_fp32_choices(smollm2_dir, bf16_kernels):
    """The real model on real text: bf16 decode products move the next token's logprobs a
    little and keep fp32's choice (or a near-tie of it)."""
    engines = {
        dtype: make_engine(
            smollm2_dir,
            decode_dtype=dtype,
            prefill_dtype="float32",
            max_model_len=256,
            num_threads=2,
        )
        for dtype in ("float32", "bfloat16")
    }
    prompts = [engines["float32"].tokenizer.encode(text) for text in SENTENCES]
    fp32 = first_token_logprobs(engines["float32"], prompts, position=1)
    bf16 = first_token_logprobs(engines["bfloat16"], prompts, position=1)
    deltas = []
    for ours, theirs in zip(bf16, fp32, strict=True):
        token = max(ours, key=ours.__getitem__)
        assert token in theirs and max(theirs.values()) - theirs[token] < 0.05, (ours, theirs)
        deltas.append(abs(ours[token] - theirs[token]))
    print(f"second-token logprob deltas under bf16 decode: {deltas}")
    assert 0 < max(deltas) < 0.1
    assert first_token_logprobs(engines["bfloat16"], prompts[:1])  # prefill still answers


@pytest.mark.parametrize(
    "m,hidden,inter",
    [(16, 64, 96), (40, 576, 1536), (33, 96, 64), (5, 64, 96), (7, 64, 80)],  # 80: odd blocks
)
def test_the_fused_mlp_matches_the_products_with_silu_between(kernels, m, hidden, inter):
    """slotserve_mlp_bf16: on the AMX tiles (16 rows or more) one pass writes each gate/up
    block's silu(gate) * up as the down product's bf16 rows (gemm_amx.c's mlp_bf16_amx, what a
    bf16 prefill step runs); on VDPBF16PS the same in registers (bf16_avx512.c's mlp_bf16_rows,
    two blocks of gate and up a tile, one where inter / 16 is odd); elsewhere the two products
    with SiLU between. Each against the reference in float64 with the same bf16 roundings, and
    the tiles against the vectors."""
    torch.manual_seed(m + hidden + inter)
    x = torch.randn(m, hidden)
    gate_up = (torch.randn(2 * inter, hidden) / hidden**0.5).to(torch.bfloat16)
    down = (torch.randn(hidden, inter) / inter**0.5).to(torch.bfloat16)
    xb = x.to(torch.bfloat16).double()
    both = xb @ gate_up.double().T
    act = torch.nn.functional.silu(both[:, :inter]) * both[:, inter:]
    expected = act.float().to(torch.bfloat16).double() @ down.double().T
    scale = expected.abs().max().item()
    results = {}
    units = [(kernels.isa, False)] + ([(kernels.isa, True)] if kernels.set_amx(True) else [])
    try:
        for isa, amx in units:
            kernels.set_amx(amx)
            got = kernels.mlp_bf16(x, pack_bf16(gate_up), pack_bf16(down), inter)
            # A silu(gate) * up on a bf16 rounding boundary may round the other way.
            assert (got.double() - expected).abs().max().item() <= 1e-3 * scale, (isa, amx)
            assert (got.double() - expected).abs().mean().item() <= 1e-5 * scale, (isa, amx)
            results[amx] = got
    finally:
        kernels.set_amx(True)
    if True in results:
        assert (results[True] - results[False]).abs().mean().item() <= 1e-5 * scale
    with pytest.raises(ValueError, match="mlp_bf16 takes packed"):
        kernels.mlp_bf16(x, pack_bf16(gate_up[:-16]), pack_bf16(down), inter)
    with pytest.raises(ValueError, match="mlp_bf16 takes packed"):
        kernels.mlp_bf16(x, pack_bf16(gate_up).float(), pack_bf16(down), inter)
