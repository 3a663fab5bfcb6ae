"""int16 products (issue 24, item 2, for CPUs without bf16 units): prefill and decode steps
multiply packed int16 weights by rows scaled to int16 per 64 columns, exact int32 sums per
group, with VPDPWSSD (``kernels/int16_vnni.c``) where the kernels run AVX-512 on a CPU with VNNI,
or VPMADDWD (``kernels/int16_avx2.c``) where they run AVX2; the plain C version (``int16.c``)
computes the same integers and fp32 operations, so every version agrees with it to the bit on
every shape."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from slotserve.engine.core.kernels import ISAS, NativeKernels, load_kernels, pack_int16
from slotserve.engine.core.model import bf16_prefill
from slotserve.engine.core.model.int16_products import wants_int16
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import make_engine, model_runner, step_hidden


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


# Each version of the product this CPU runs: the ISA level that selects it, and its name.
VERSIONS = {"plain_c": ("plain_c", "plain_c"), "avx2": ("avx2_fma", "avx2"),
            "vnni": ("avx512", "avx512_vnni")}  # fmt: skip


@pytest.fixture(params=list(VERSIONS))
def isa(request, kernels: NativeKernels) -> Iterator[str]:
    level, name = VERSIONS[request.param]
    if level not in kernels.supported_isas:
        pytest.skip(f"this CPU cannot run {level}")
    kernels.set_isa(level)
    try:
        if kernels.int16_products != name:
            pytest.skip(f"this CPU's int16 products at {level} run {kernels.int16_products}")
        yield request.param
    finally:
        kernels.set_isa(ISAS[-1])


def bound(x: torch.Tensor, w: torch.Tensor) -> float:
    """The worst error of the product: every row element off by half its group's step (max /
    4095), every weight by half its channel's (max / 8191), k of them."""
    k = x.shape[1]
    return k * x.abs().max().item() * w.abs().max().item() * (0.5 / 4095 + 0.5 / 8191 + 1e-6)


# (rows, channels, k): one row and one group; a partial last group (98 = 64 + 34) and a channel
# count that is no multiple of 16; k = 2; two rows (AVX2's decode tiles); six and eight rows
# (AVX2's six-row tile, then two); SmolLM2's down and q/k/v shapes; more rows than one span of
# 256 (two spans, the second short).
SHAPES = [
    (1, 16, 64), (3, 33, 98), (9, 100, 2), (2, 40, 130), (6, 24, 192), (8, 50, 320),
    (17, 576, 1536), (130, 960, 576), (300, 48, 128),
]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_product_is_within_the_int16_steps_and_both_versions_agree_to_the_bit(
    kernels, isa, shape
):
    m, n, k = shape
    torch.manual_seed(m * n + k)
    x = torch.randn(m, k)
    x[:, :3] *= 40.0  # outlier columns, as a model's activations have: only their group pays
    w = torch.randn(n, k) * 0.05
    packed, scale = pack_int16(w)
    got = kernels.gemm_int16(x, packed, scale, n)
    reference = x.double() @ w.double().T
    assert got.shape == (m, n)
    assert (got.double() - reference).abs().max().item() <= bound(x, w)
    if isa != "plain_c":
        # The plain C version: the same integers, the same fp32 operations in the same order.
        kernels.set_isa("plain_c")
        assert torch.equal(got, kernels.gemm_int16(x, packed, scale, n))


def test_every_product_at_its_bound_fits_the_int32_sums(kernels, isa):
    # Rows and weights at their largest magnitude in every column: each group's 64 products
    # sum to 64 * 4095 * -8191, just inside int32; a wider group or bound would wrap here.
    m, n, k = 8, 48, 64 * 5
    x, w = torch.full((m, k), 3.0), torch.full((n, k), -0.7)
    got = kernels.gemm_int16(x, *pack_int16(w), n)
    torch.testing.assert_close(got, torch.full((m, n), -3.0 * 0.7 * k), rtol=1e-6, atol=0)


def test_non_finite_rows_give_non_finite_results_and_zero_rows_zeros(kernels, isa):
    x = torch.randn(4, 128)
    x[1, 70] = float("nan")
    x[2, 5] = float("inf")
    x[3] = 0.0
    w = torch.randn(20, 128)
    got = kernels.gemm_int16(x, *pack_int16(w), 20)
    assert torch.isfinite(got[0]).all()
    assert not torch.isfinite(got[1]).any() and not torch.isfinite(got[2]).any()
    assert torch.equal(got[3], torch.zeros(20))


def test_bad_weights_and_shapes_are_refused(kernels):
    with pytest.raises(ValueError, match="even K"):
        pack_int16(torch.randn(16, 33))
    with pytest.raises(ValueError, match="finite"):
        pack_int16(torch.tensor([[1.0, float("inf")]]))
    packed, scale = pack_int16(torch.randn(20, 64))
    assert kernels.gemm_int16(torch.zeros(0, 64), packed, scale, 20).shape == (0, 20)
    with pytest.raises(ValueError, match="gemm_int16"):
        kernels.gemm_int16(torch.randn(2, 64), packed, scale[:16], 20)
    with pytest.raises(ValueError, match="gemm_int16"):
        kernels.gemm_int16(torch.randn(2, 62), packed, scale, 20)
    with pytest.raises(ValueError, match="gemm_int16"):
        kernels.gemm_int16(torch.randn(2, 64), packed.float(), scale, 20)


@pytest.mark.parametrize("m", [1, 32, 300])
def test_int16_products_allocate_nothing_once_the_workspace_has_grown(kernels, isa, m):
    packed, scale = pack_int16(torch.randn(96, 576))
    x = torch.randn(m, 576)
    first = kernels.gemm_int16(x, packed, scale, 96)
    before = kernels.fallback_allocations()
    for _ in range(5):
        again = kernels.gemm_int16(x, packed, scale, 96)
    assert kernels.fallback_allocations() == before
    assert torch.equal(again, first)


def test_auto_takes_int16_only_where_simd_int16_runs_without_bf16_units(kernels):
    simd = kernels.int16_products != "plain_c"
    assert wants_int16("auto", [], kernels) is simd
    assert not wants_int16("auto", ["avx512_bf16"], kernels)
    assert not wants_int16("float32", [], kernels)
    assert not wants_int16("bfloat16", [], kernels)
    assert wants_int16("int16", ["avx512_bf16"], kernels) is simd
    assert not wants_int16("int16", [], None)
    kernels.set_isa("plain_c")  # correct, and slower than fp32's panels: never chosen
    try:
        assert kernels.int16_products == "plain_c" and not wants_int16("int16", [], kernels)
    finally:
        kernels.set_isa(ISAS[-1])


@pytest.mark.parametrize(
    ("isa", "products", "auto"),
    [
        ("avx2_fma", "avx2", True),  # a Zen 3 EPYC: VPMADDWD beside AVX2's fp32 panels
        ("avx512", "avx512_vnni", True),  # a Cascade Lake Xeon
        ("avx512", "avx2", False),  # a Skylake Xeon: AVX-512's fp32 panels outrun VPMADDWD
        ("plain_c", "plain_c", False),
    ],
)
def test_auto_takes_int16_where_it_outruns_the_fp32_panels(isa, products, auto):
    # The decision reads these two properties only; a CPU of each kind is not at hand here.
    shown = cast(NativeKernels, SimpleNamespace(isa=isa, int16_products=products))
    assert wants_int16("auto", [], shown) is auto
    assert wants_int16("int16", [], shown) is (products != "plain_c")


def test_a_cpu_without_bf16_units_prefills_and_decodes_in_int16_by_default(
    kernels, isa, tiny_model_dir, monkeypatch, caplog
):
    if isa == "plain_c":
        pytest.skip("int16 in plain C is never chosen")
    code = VERSIONS[isa][1]
    # The CPU as a Zen 3 EPYC (AVX2) or a Cascade Lake Xeon (VNNI) shows itself: no bf16 units.
    identity = bf16_prefill.cpu_identity()
    flags = " ".join(
        f for f in identity.get("cpu_flags", "").split() if f not in bf16_prefill.BF16_UNITS
    )
    monkeypatch.setattr(bf16_prefill, "cpu_identity", lambda: {**identity, "cpu_flags": flags})
    with caplog.at_level(logging.INFO):
        engine = make_engine(
            tiny_model_dir, prefill_dtype="auto", decode_dtype="auto", max_batch_size=8
        )
    runner = model_runner(engine)
    assert runner.prefill_bf16 and runner.decode_bf16
    assert f"prefill and decode products in int16 on {code} (native kernels" in caplog.text
    layers = bf16_prefill.decoder_linears(runner.model)
    assert layers and all(
        layer.weight_int16 is not None and layer.weight_packed is None for layer in layers
    )
    # /load's calibrations name the route too.
    (record,) = [c for c in runner.calibrations if c.name == "native_kernels"]
    assert record.figures == {f"int16_{code}": 1.0}
    # The native row count is the CPU-feature rule's, named for the int16 decode products.
    (rows_record,) = [c for c in runner.calibrations if c.name == "native_rows"]
    assert rows_record.source == "rule" and rows_record.figures == {"int16_decode": 1.0}
    # A 40-row prefill chunk and an 8-row decode step: int16 products with the gate on, fp32
    # with it off (a prompt being scored); they differ by int16's rounding and no more.
    for rows, decode in ((40, False), (8, True)):
        int16 = step_hidden(engine, rows, True, decode=decode)
        fp32 = step_hidden(engine, rows, False, decode=decode)
        assert not torch.equal(int16, fp32)
        torch.testing.assert_close(int16, fp32, rtol=0.02, atol=0.02)
    # The same engine generates what the fp32 engine generates (greedy, a short prompt).
    reference = make_engine(tiny_model_dir, prefill_dtype="float32", decode_dtype="float32")
    from slotserve.engine.core.params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = ["The quick brown fox jumps over the lazy dog. " * 6]
    assert [r.token_ids for r in engine.generate(prompt, params)] == [
        r.token_ids for r in reference.generate(prompt, params)
    ]


def test_int16_that_cannot_run_warns_once_and_prefills_in_fp32(kernels, tiny_model_dir, caplog):
    kernels.set_isa("plain_c")  # as on a CPU without AVX2
    try:
        with caplog.at_level(logging.INFO):
            engine = make_engine(tiny_model_dir, prefill_dtype="int16", decode_dtype="float32")
    finally:
        kernels.set_isa(ISAS[-1])
    assert not model_runner(engine).prefill_bf16
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert (
        "prefill_dtype int16 needs the native kernels on a CPU with AVX2 or AVX512_VNNI"
        in (warnings[0])
    )


def test_int16_asked_for_one_side_turns_bf16_off_on_the_other(kernels, tiny_model_dir, caplog):
    if kernels.int16_products == "plain_c":
        pytest.skip("this CPU has no AVX2")
    with caplog.at_level(logging.INFO):
        engine = make_engine(tiny_model_dir, prefill_dtype="float32", decode_dtype="int16")
    runner = model_runner(engine)
    assert runner.decode_bf16 and not runner.prefill_bf16
    layers = bf16_prefill.decoder_linears(runner.model)
    assert all(layer.weight_int16 is not None and layer.weight_packed is None for layer in layers)
    assert f"decode products in int16 on {kernels.int16_products}" in caplog.text


def test_int16_on_quantized_layers_warns_and_keeps_their_precision(kernels, tiny_model_dir, caplog):
    if kernels.int16_products == "plain_c":
        pytest.skip("this CPU has no AVX2")
    with caplog.at_level(logging.WARNING):
        engine = make_engine(
            tiny_model_dir, quantization="int4", prefill_dtype="int16", decode_dtype="float32"
        )
    assert not model_runner(engine).prefill_bf16
    assert "prefill_dtype int16 needs the decoder's linear layers on the native kernels" in (
        caplog.text
    )
