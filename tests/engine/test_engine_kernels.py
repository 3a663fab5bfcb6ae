"""The native kernels against torch: products equal dequantized matmuls, quantizers equal a torch
reference byte for byte, on the AVX2/FMA code and on the plain C fallback alike."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from slotserve.engine.core.kernels import GROUP_SIZE, ISAS, NativeKernels, load_kernels
from slotserve.settings import CommonSettings


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


# avx512_bf16 runs the avx512 code for fp32, int8 and int4 weights (it adds the bf16 products
# and attention, which test_engine_bf16_*.py test on every instruction set).
FP32_ISAS = [isa for isa in ISAS if isa != "avx512_bf16"]


@pytest.fixture(params=FP32_ISAS)
def isa(request, kernels: NativeKernels) -> Iterator[str]:
    """Every instruction set with its own code for these kernels; those this CPU lacks are
    skipped."""
    if kernels.set_isa(request.param) != request.param:
        pytest.skip(f"this CPU cannot run {request.param}")
    yield request.param
    kernels.set_isa(ISAS[-1])


def reference_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scale = groups.abs().amax(-1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), scale


def dequantize_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.reshape(n, -1, GROUP_SIZE).float() * scale[..., None]).reshape(n, k)


def reference_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    half = GROUP_SIZE // 2
    return (q[..., :half] | (q[..., half:] << 4)).reshape(n, k // 2), scale, low


def dequantize_q4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    n = q.shape[0]
    grouped = q.reshape(n, -1, GROUP_SIZE // 2)
    values = torch.cat([grouped & 0x0F, grouped >> 4], dim=-1).float()
    return (values * scale[..., None] + minimum[..., None]).reshape(n, -1)


def int4_one_row_bound(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, slack: float = 1e-4
) -> torch.Tensor:
    """How far the AVX2 one-row int4 product may be from the dequantized matmul, per output: it
    rounds the row to 16 bits per group of 32 (step max|x| / 32767 but at least FLT_MIN, error
    at most half a step),
    and each rounding error meets a weight's nibble times its group's scale."""
    n = q.shape[0]
    grouped = q.reshape(n, -1, GROUP_SIZE // 2)
    nibbles = torch.cat([grouped & 0x0F, grouped >> 4], dim=-1).float()  # [n, groups, 32]
    tiny = torch.finfo(torch.float32).tiny  # the kernel's smallest step (FLT_MIN)
    step = (x.reshape(-1, GROUP_SIZE).abs().amax(-1) / 32767).clamp(min=tiny)  # [groups]
    rounding = (nibbles.sum(-1) * scale * step / 2).sum(-1)  # [n]
    return rounding + slack  # plus the fp32 sums' own rounding


def assert_int4_close(
    out: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, ref: torch.Tensor
) -> None:
    """``out`` within the one-row bound of ``ref`` for one-row AVX2 products, else as fp32."""
    if x.shape[0] == 1 and load_kernels(CommonSettings().home).avx2:
        error = (out - ref).abs()[0]
        bound = int4_one_row_bound(x[0], q, scale) + 1e-4 * ref.abs()[0]
        assert bool((error <= bound).all()), f"{(error - bound).max()} past the bound"
    else:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# Panels are 4 output channels: 6 and 10 leave a partial last panel; K 96 is not a multiple of
# 16 (the one-row loop's unrolled step). Rows: 4 and 8 take the four-row loop, 3 and 33 the
# three-row one, 2 and 5 the two-row one (5 after three rows), 1 the one-row loop.
# K 96 and 160 are not multiples of 64; 32 is under one 512-bit step twice over. 64 rows and
# more take the wide products. AVX2: weights packed 16 channels a block, rows split in two
# tasks of 6-row tiles (64: 36 + 28, a 4-row tail; 77: 42 + 35, a 5-row tail), N 132 eight
# full blocks and 4 channels, N 6 and 10 one partial block. AVX-512: groups of 16 panels,
# blocks of 12 rows (77 leaves 5), N 132 two full groups and one panel.
SHAPES = [(64, 64), (6, 96), (10, 32), (132, 160)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 33, 64, 77])
def test_products_equal_dequantized_matmuls(kernels, isa, n, k, m):
    generator = torch.Generator().manual_seed(n * 1000 + k + m)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(m, k, generator=generator)
    torch.testing.assert_close(kernels.gemm_f32(x, weight), x @ weight.T, rtol=1e-4, atol=1e-4)
    q8, s8 = kernels.quantize_q8(weight)
    torch.testing.assert_close(
        kernels.gemm_q8(x, q8, s8), x @ dequantize_q8(q8, s8).T, rtol=1e-4, atol=1e-4
    )
    q4, s4, m4 = kernels.quantize_q4(weight)
    reference = x @ dequantize_q4(q4, s4, m4).T
    assert_int4_close(kernels.gemm_q4(x, q4, s4, m4), x, q4, s4, reference)
    torch.testing.assert_close(kernels.dequantize_q8(q8, s8), dequantize_q8(q8, s8))
    torch.testing.assert_close(kernels.dequantize_q4(q4, s4, m4), dequantize_q4(q4, s4, m4))


def test_one_row_int4_keeps_tiny_groups_and_passes_non_finite_values_on(kernels, isa):
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(12, 64, generator=generator)
    q4, s4, m4 = kernels.quantize_q4(weight)
    dense = dequantize_q4(q4, s4, m4)
    # A group of values near 1e-37 with zeros among them: its step must not overflow when
    # inverted (the zeros came back as -32767 steps, 8x past the bound), so the step is at
    # least FLT_MIN and the error stays within half of it per value.
    x = torch.zeros(1, 64)
    x[0, :16] = 1e-37 * torch.rand(16, generator=generator)
    out, ref = kernels.gemm_q4(x, q4, s4, m4), x @ dense.T
    if isa != "plain_c":
        rounding = int4_one_row_bound(x[0], q4, s4, slack=0.0)  # the rounding part alone
        assert bool(((out - ref).abs()[0] <= rounding * 1.01 + 1e-5 * ref.abs()[0]).all())
    else:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=0.0)
    x[0, 32:] = torch.randn(32, generator=generator)
    for bad in (float("nan"), float("inf"), -float("inf")):
        row = x.clone()
        row[0, 40] = bad
        out, ref = kernels.gemm_q4(row, q4, s4, m4), row @ dense.T
        assert not torch.isfinite(ref).any()
        assert not torch.isfinite(out).any(), bad  # never a finite answer from a bad row


@pytest.mark.parametrize("distance", [0, 256, 4096])
@pytest.mark.parametrize("m", [1, 4])
def test_prefetching_changes_no_result(kernels, distance, m):
    """Every prefetch distance (0: none) gives the same bits, up to the last panel and channel
    (1,030 channels: a partial last panel)."""
    generator = torch.Generator().manual_seed(m)
    weight = torch.randn(1030, 192, generator=generator)
    x = torch.randn(m, 192, generator=generator)
    q8, q4 = kernels.quantize_q8(weight), kernels.quantize_q4(weight)

    def products() -> list[torch.Tensor]:
        return [kernels.gemm_f32(x, weight), kernels.gemm_q8(x, *q8), kernels.gemm_q4(x, *q4)]

    kernels.set_prefetch(None)
    default = products()
    kernels.set_prefetch(distance)
    try:
        for got, want in zip(products(), default, strict=True):
            assert torch.equal(got, want)
    finally:
        kernels.set_prefetch(None)


@pytest.mark.parametrize("n,k", SHAPES)
def test_quantizers_equal_the_torch_reference_and_bound_the_error(kernels, isa, n, k):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05
    weight[0, :GROUP_SIZE] = 0.0  # a group of zeros: scale 1, all codes 0, no division by zero
    q8, s8 = kernels.quantize_q8(weight)
    ref_q8, ref_s8 = reference_q8(weight)
    assert torch.equal(q8, ref_q8)
    torch.testing.assert_close(s8, ref_s8)
    error = (dequantize_q8(q8, s8) - weight).abs().reshape(n, -1, GROUP_SIZE)
    assert (error <= s8[..., None] / 2 + 1e-7).all()

    q4, s4, m4 = kernels.quantize_q4(weight)
    ref = reference_q4(weight)
    assert torch.equal(q4, ref[0])
    torch.testing.assert_close((s4, m4), ref[1:])
    error = (dequantize_q4(q4, s4, m4) - weight).abs().reshape(n, -1, GROUP_SIZE)
    assert (error <= s4[..., None] / 2 + 1e-6).all()


def test_weights_on_the_int4_grid_come_back_exactly(kernels):
    """A model that was Q4_1 (the bundled SmolLM2) keeps its layers exactly under int4."""
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    snapped = dequantize_q4(*kernels.quantize_q4(weight))
    again = kernels.quantize_q4(snapped)
    torch.testing.assert_close(dequantize_q4(*again), snapped, rtol=0, atol=1e-6)


def test_bad_inputs_are_refused_not_read_past(kernels):
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.quantize_q4(torch.randn(4, 40))
    with pytest.raises(ValueError, match="contiguous 2-D float32"):
        kernels.gemm_f32(torch.randn(4, 8).t(), torch.randn(4, 4))
    with pytest.raises(ValueError, match="contiguous 2-D float32"):
        kernels.gemm_f32(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8))


@pytest.mark.parametrize(
    "rows,lens", [(1, [7]), (3, [5, 0, 40]), (4, [64, 1, 33, 2]), (2, [50, 3])]
)
# Query heads per kv head: pairs and a single one left over; head sizes: under 64, 64 (one
# block of values in registers), 136 (two blocks and a leftover 8).
@pytest.mark.parametrize("group,d", [(3, 16), (2, 64), (1, 136)])
def test_decode_attention_equals_masked_softmax_attention(kernels, isa, rows, lens, group, d):
    generator = torch.Generator().manual_seed(rows)
    slots, kv_heads, max_len = 5, 2, 64
    k = torch.randn(slots, kv_heads, max_len, d, generator=generator)
    v = torch.randn(slots, kv_heads, max_len, d, generator=generator)
    k[:, :, 50:] = float("nan")  # past every row's length but the full one: never read
    v[:, :, 50:] = float("nan")
    k[3], v[3] = k[3].nan_to_num(), v[3].nan_to_num()
    if rows == 4:
        k[0], v[0] = k[0].nan_to_num(), v[0].nan_to_num()
    q = torch.randn(rows, kv_heads, group, d, generator=generator)
    out = kernels.decode_attention(q, k, v, torch.tensor(lens), 0.25)
    for row, length in enumerate(lens):
        if length == 0:
            assert torch.equal(out[row], torch.zeros_like(out[row]))
            continue
        keys, values = k[row, :, :length], v[row, :, :length]
        scores = torch.softmax(q[row] @ keys.transpose(-1, -2) * 0.25, dim=-1)
        torch.testing.assert_close(out[row], scores @ values, rtol=1e-4, atol=1e-5)
