"""Prefill attention in bf16 (issue 24): the blocks of a chunk's rows with queries, keys, values
and probabilities rounded to bf16 and fp32 sums, against a float64 reference that rounds the
same values; chunks across several blocks, at an offset into the cache, of odd lengths; on the
VDPBF16PS blocks and, where the CPU has them, the AMX tiles (which round the exponentials before
normalising and scale each output once, as FlashAttention does). Below AVX512_BF16 the same
call is the fp32 attention, bit for bit."""

from __future__ import annotations

import pytest
import torch

from slotserve.engine.core.kernels import ISAS, NativeKernels, load_kernels
from slotserve.settings import CommonSettings

KV_HEADS, GROUP, D, MAX_LEN, SCALE = 3, 3, 64, 700, 0.125


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


def chunk(start: int, rows: int, seed: int):
    """A chunk of ``rows`` rows of cache row 1 at positions start .. start + rows - 1."""
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(2, KV_HEADS, MAX_LEN, D, generator=generator)
    v = torch.randn(2, KV_HEADS, MAX_LEN, D, generator=generator)
    q = torch.randn(rows, KV_HEADS, GROUP, D, generator=generator)
    slots = torch.ones(rows, dtype=torch.int64)
    lens = torch.arange(start + 1, start + rows + 1, dtype=torch.int64)
    return q, k, v, slots, lens


def reference(q, k, v, lens) -> torch.Tensor:
    """Each row's attention with q, k, v and the probabilities rounded to bf16, in float64, as
    both bf16 units round them: the exponentials rounded unnormalised and the output divided by
    their unrounded sum afterwards (FlashAttention's order)."""

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).double()

    out = torch.empty(q.shape, dtype=torch.float64)
    for r, length in enumerate(lens.tolist()):
        for h in range(KV_HEADS):
            scores = (bf16(q[r, h]) @ bf16(k[1, h, :length]).T) * SCALE
            exps = torch.exp(scores - scores.max(dim=-1, keepdim=True).values).float()
            out[r, h] = (bf16(exps) @ bf16(v[1, h, :length])) / exps.double().sum(-1, True)
    return out


@pytest.fixture(params=["vdpbf16ps", "amx"])
def bf16_unit(request, kernels: NativeKernels):
    """Each bf16 attention this CPU runs: the VDPBF16PS blocks, and the AMX tiles' where it has
    them (attention_amx.c)."""
    if "avx512_bf16" not in kernels.supported_isas:
        pytest.skip("this CPU has no AVX512_BF16")
    on = kernels.set_amx(request.param == "amx")
    try:
        if on != (request.param == "amx"):
            pytest.skip("this CPU (or its kernel) gives no AMX tiles")
        yield request.param
    finally:
        kernels.set_amx(True)


@pytest.mark.parametrize("start,rows", [(0, 40), (0, 300), (450, 129), (3, 5), (601, 2), (0, 17)])
def test_bf16_blocks_match_the_rounded_reference(kernels, bf16_unit, start, rows):
    q, k, v, slots, lens = chunk(start, rows, seed=start + rows)
    got = kernels.slot_attention(q, k, v, slots, lens, SCALE, bf16=True)
    fp32 = kernels.slot_attention(q, k, v, slots, lens, SCALE)
    expected = reference(q, k, v, lens)
    # A probability on a bf16 rounding boundary may round the other way (another exp).
    assert (got.double() - expected).abs().max().item() < 2e-3
    assert (got - fp32).abs().max().item() > 0  # bf16 did run
    assert (got - fp32).abs().max().item() < 5e-2


def test_the_amx_tiles_and_vdpbf16ps_agree(kernels):
    if not kernels.set_amx(True):
        pytest.skip("this CPU (or its kernel) gives no AMX tiles")
    q, k, v, slots, lens = chunk(200, 333, seed=11)
    tiles = kernels.slot_attention(q, k, v, slots, lens, SCALE, bf16=True)
    kernels.set_amx(False)
    try:
        vectors = kernels.slot_attention(q, k, v, slots, lens, SCALE, bf16=True)
    finally:
        kernels.set_amx(True)
    # The same operands and roundings, the fp32 sums in another order: an exponential on a
    # bf16 rounding boundary may round the other way, no more.
    assert 0 < (tiles - vectors).abs().max().item() < 1e-2
    assert (tiles - vectors).abs().mean().item() < 1e-3


def test_below_avx512_bf16_the_call_is_the_fp32_attention(kernels):
    q, k, v, slots, lens = chunk(100, 70, seed=7)
    try:
        for isa in kernels.supported_isas:
            if isa == "avx512_bf16":
                continue
            kernels.set_isa(isa)
            bf16 = kernels.slot_attention(q, k, v, slots, lens, SCALE, bf16=True)
            assert torch.equal(bf16, kernels.slot_attention(q, k, v, slots, lens, SCALE)), isa
    finally:
        kernels.set_isa(ISAS[-1])
