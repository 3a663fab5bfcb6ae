"""The fp16 KV cache (issue 24; kernels/kv_half.c, model/kv_dtype.py): attention over an fp16
cache equals attention over the same values in fp32 on every instruction set this CPU runs
(decode rows, prefill blocks, bf16 blocks); the native step stores keys and values rounded as
torch rounds them, saturating past fp16's range instead of writing inf; the torch path reads and
writes the same cache; an engine on it scores SmolLM2's prompts within a hair of the fp32 cache;
and ``kv_cache_dtype`` resolves, or refuses, as documented."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.kernels import ISAS, NativeKernels, load_kernels
from slotserve.engine.core.model.kv_dtype import HALF_MAX, pick_kv_dtype, to_cache
from slotserve.engine.core.params import SamplingParams
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    make_engine,
    make_prompts,
    model_runner,
    run_staggered,
)
from tests.engine.test_engine_quantize import run_engine

TEXT = Path(__file__).parents[2] / "bench" / "data" / "quality_text.txt"


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


@pytest.fixture(params=ISAS)
def isa(request, kernels) -> Iterator[str]:
    """Every instruction set this CPU runs (the others skip), the plain C reference included."""
    if request.param not in kernels.supported_isas:
        pytest.skip(f"this CPU does not run {request.param}")
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(kernels.supported_isas[-1])


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny-kv", smollm2_dir)


def caches(slots: int, kv_heads: int, max_len: int, d: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, kv_heads, max_len, d, generator=generator).half()
    v = torch.randn(slots, kv_heads, max_len, d, generator=generator).half()
    return k, v


# ---- reading: the same attention as over the widened values ------------------------------------


# d 20: plain C row by row; 64 and 128 whole 64-wide value passes on AVX-512, 80 one of 64 and
# one of 16, 48 and 24 short ones (24: AVX2 on every CPU); groups 3 (one pass of 3 heads), 4, 5
# and 8 (passes of 4 and 1, 4 and 4); lengths with a tail of 1-3 keys past the fours.
@pytest.mark.parametrize("d", [64, 20, 80, 128, 48, 24])
@pytest.mark.parametrize("group", [3, 1, 5, 8])
def test_decode_rows_over_fp16_equal_the_fp32_attention_of_the_same_values(kernels, isa, d, group):
    rows, kv_heads, max_len = 5, 2, 150
    k, v = caches(rows + 1, kv_heads, max_len, d, seed=d * 10 + group)
    q = torch.randn(rows, kv_heads, group, d, generator=torch.Generator().manual_seed(group))
    lens = torch.tensor([1, 2, 7, 149, 150], dtype=torch.int64)
    scale = 1.0 / math.sqrt(d)
    got = kernels.decode_attention(q, k, v, lens, scale)
    widened = kernels.decode_attention(q, k.float(), v.float(), lens, scale)
    # Only the order of the fp32 sums may differ (the 512-bit fp16 head sums by 16 lanes).
    torch.testing.assert_close(got, widened, rtol=1e-5, atol=2e-6)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize(("start", "length"), [(0, 37), (50, 70), (3, 2)])
def test_prefill_blocks_over_fp16_equal_the_fp32_blocks_of_the_same_values(
    kernels, isa, bf16, start, length
):
    """A chunk of slot 1 beside a decode row of slot 0: the blocks widen the slot's keys and
    values once and then run as they do over fp32 (bit for bit, bf16 blocks included)."""
    kv_heads, group, d, max_len = 3, 3, 64, 128
    k, v = caches(2, kv_heads, max_len, d, seed=start + length)
    q = torch.randn(length + 1, kv_heads, group, d, generator=torch.Generator().manual_seed(9))
    slots = torch.tensor([1] * length + [0])
    lens = torch.tensor([start + i + 1 for i in range(length)] + [60])
    got = kernels.slot_attention(q, k, v, slots, lens, 0.125, bf16=bf16)
    widened = kernels.slot_attention(q, k.float(), v.float(), slots, lens, 0.125, bf16=bf16)
    torch.testing.assert_close(got[:length], widened[:length], rtol=0, atol=0)
    torch.testing.assert_close(got[length:], widened[length:], rtol=1e-5, atol=2e-6)


def test_caches_of_two_dtypes_or_another_dtype_are_refused(kernels):
    q = torch.randn(1, 1, 1, 16)
    half, full = torch.zeros(1, 1, 4, 16).half(), torch.zeros(1, 1, 4, 16)
    lens = torch.tensor([1])
    with pytest.raises(ValueError, match="dtype"):
        kernels.decode_attention(q, half, full, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        kernels.decode_attention(q, half.bfloat16(), half.bfloat16(), lens, 1.0)


# ---- writing: the native step rounds as torch does, and saturates ------------------------------


def prefill_caches(model_dir: Path, kv_cache_dtype: str, prompt: list[int]):
    engine = make_engine(
        model_dir, max_batch_size=2, linear_backend="native", kv_cache_dtype=kv_cache_dtype
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (seq,) = run_staggered(engine, [prompt], params, every=1, per=1)
    runner = model_runner(engine)
    assert runner.k_cache[0].dtype == (
        torch.float16 if kv_cache_dtype == "float16" else torch.float32
    )
    return runner, seq


def test_the_native_step_stores_keys_and_values_as_torch_rounds_them(sharp_dir, isa):
    """Layer 0's keys and values depend on the prompt's embeddings alone, so the fp16 engine's
    must be the fp32 engine's rounded to fp16, bit for bit (plain C and F16C alike)."""
    prompt = make_prompts(4, seed=11)[3]
    fp32, _ = prefill_caches(sharp_dir, "float32", prompt)
    half, seq = prefill_caches(sharp_dir, "float16", prompt)
    assert fp32.native_step is not None and half.native_step is not None
    n = len(prompt)
    for cache32, cache16 in (
        (fp32.k_cache[0], half.k_cache[0]),
        (fp32.v_cache[0], half.v_cache[0]),
    ):
        assert torch.equal(cache16[0, :, :n], cache32[0, :, :n].half())
    assert len(seq.generated_token_ids) == 4


def test_keys_past_fp16s_range_are_stored_saturated_and_the_answer_stays_finite(
    tmp_path, sharp_dir
):
    """Keys scaled far past 65504: the cache holds +-65504 (never inf, which would make every
    score of the row NaN) and the request ends normally on both paths."""
    model = AutoModelForCausalLM.from_pretrained(str(sharp_dir), dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1e5)
    loud = tmp_path / "loud"
    model.save_pretrained(loud)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (sharp_dir / name).exists():
            (loud / name).write_bytes((sharp_dir / name).read_bytes())
    prompt = make_prompts(3, seed=2)[2]
    runner, seq = prefill_caches(loud, "float16", prompt)
    keys = runner.k_cache[0][0, :, : len(prompt)].float()
    assert torch.isfinite(keys).all()
    assert keys.abs().max().item() == HALF_MAX
    assert seq.finish_reason == "length" and len(seq.generated_token_ids) == 4
    # The torch path's writes saturate the same way.
    rows = torch.tensor([[1e9, -1e9, 3.0, float("nan")]])
    stored = to_cache(rows, torch.empty(0, dtype=torch.float16))
    assert stored[0, :3].tolist() == [HALF_MAX, -HALF_MAX, 3.0] and stored[0, 3].isnan()


def test_the_torch_path_reads_and_writes_the_fp16_cache_as_the_native_step(sharp_dir):
    """Every step through transformers (the slot attention's writes and reads) on an fp16
    cache: the tokens of the native step on the same cache."""
    prompts = make_prompts(6, seed=4)
    settings = {"max_batch_size": 3, "max_batched_tokens": 16, "linear_backend": "native"}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = []
    for native in (True, False):
        engine = make_engine(sharp_dir, kv_cache_dtype="float16", **settings)
        if not native:
            model_runner(engine).native_step = None
        seqs = run_staggered(engine, prompts, params, every=2, per=2)
        results.append([seq.generated_token_ids for seq in seqs])
    assert results[0] == results[1]


# ---- quality: SmolLM2's prompt logprobs on real text -------------------------------------------


def test_smollm2_scores_real_text_on_fp16_as_on_fp32(smollm2_dir):
    """Prompt logprobs of ~300 tokens of the shipped text (teacher-forced: every position reads
    the cache the earlier ones wrote): the fp16 cache moves each by a hair and keeps the top
    choice nearly everywhere (bench/quant_quality.py measures it over the whole text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tokenizer.encode(TEXT.read_text()[:1500])[:300]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    scored = {}
    for dtype in ("float32", "float16"):
        engine = make_engine(
            smollm2_dir, max_batch_size=1, max_batched_tokens=128, kv_cache_dtype=dtype
        )
        (seq,) = run_staggered(engine, [prompt], params, every=1, per=1)
        assert seq.prompt_logprobs is not None
        scored[dtype] = [row for row in seq.prompt_logprobs[1:] if row is not None]
    pairs = list(zip(scored["float32"], scored["float16"], strict=True))
    assert len(pairs) == len(prompt) - 1
    drift = [abs(a.logprob - b.logprob) for a, b in pairs]
    same_top = sum(a.top[0][0] == b.top[0][0] for a, b in pairs) / len(pairs)
    assert max(drift) < 0.05 and sum(drift) / len(drift) < 0.005
    assert same_top >= 0.98


# ---- the setting -------------------------------------------------------------------------------


def test_kv_cache_dtype_resolves_and_refuses_as_documented(kernels):
    fp32, bf16 = torch.float32, torch.bfloat16
    assert pick_kv_dtype("auto", model_dtype=fp32, kernels=kernels, static=False) == torch.float16
    assert pick_kv_dtype("auto", model_dtype=fp32, kernels=None, static=False) == fp32
    assert pick_kv_dtype("auto", model_dtype=fp32, kernels=kernels, static=True) == fp32
    assert pick_kv_dtype("auto", model_dtype=bf16, kernels=None, static=False) == bf16
    assert pick_kv_dtype("float32", model_dtype=fp32, kernels=kernels, static=False) == fp32
    assert (
        pick_kv_dtype("float16", model_dtype=fp32, kernels=kernels, static=False) == torch.float16
    )
    with pytest.raises(UnsupportedSettingError, match="native CPU kernels"):
        pick_kv_dtype("float16", model_dtype=fp32, kernels=None, static=False)
    with pytest.raises(UnsupportedSettingError, match="native CPU kernels"):
        pick_kv_dtype("float16", model_dtype=fp32, kernels=kernels, static=True)
    with pytest.raises(UnsupportedSettingError, match="bfloat16"):
        pick_kv_dtype("float32", model_dtype=bf16, kernels=None, static=False)


def test_the_engine_reports_its_cache_dtype_and_sizes_the_cache_by_it(sharp_dir, monkeypatch):
    """The same memory budget holds twice the positions in fp16: here 2 of 8 slots of 512
    positions in fp32 (512 bytes a token for the sharp tiny model), 5 in fp16."""
    import slotserve.engine.core.model.loader as loader

    monkeypatch.setattr(loader, "available_memory_bytes", lambda device, sources: 1 << 20)
    slots = {}
    for dtype in ("float16", "float32"):
        engine = make_engine(
            sharp_dir, max_batch_size=8, kv_cache_dtype=dtype, kv_cache_memory_fraction=0.625
        )
        assert engine.stats().kv_cache_dtype == dtype  # what /load reports
        slots[dtype] = engine.kv_cache.num_slots
    assert slots == {"float32": 2, "float16": 5}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache-dtype", "float16", "--dtype", "bfloat16"], "needs the native CPU kernels"),
        (["--kv-cache-dtype", "float32", "--dtype", "bfloat16"], "needs weights of that dtype"),
    ],
    ids=["fp16-without-kernels", "fp32-under-bf16-weights"],
)
def test_a_cache_dtype_the_load_cannot_run_exits_2_with_one_line(tiny_model_dir, args, message):
    done = run_engine(["--model", str(tiny_model_dir), *args], {})
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
