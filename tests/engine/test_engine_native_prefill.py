"""Prefill chunks in the native step (issue 24, item 1): a chunk is one row per token of its
sequence's slot, causal within the chunk over the slot's cache, mixed with decode rows in one
call. Greedy tokens equal the transformers path's (SmolLM2 fp32, the tiny models, Llama /
Mistral / Qwen2, int8 / int4) across chunk boundaries, with prefix-cache hits and mixed steps;
prompt logprobs come from the native rows; the attention kernel matches a torch reference; a
steady-state prefill allocates nothing."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.kernels import NativeKernels, load_kernels
from slotserve.engine.core.model.native_decode import NativeDecodeStep
from slotserve.engine.core.params import SamplingParams
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    hf_greedy,
    make_engine,
    make_prompts,
    model_runner,
    run_staggered,
)
from tests.engine.test_engine_prefix_equivalence import shared_prefix_prompts


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


@pytest.fixture(params=["widest", "plain_c"])
def isa(request, kernels) -> Iterator[str]:
    """The widest variant this CPU runs, and the plain C reference."""
    widest = kernels.supported_isas[-1]
    kernels.set_isa(widest if request.param == "widest" else "plain_c")
    yield request.param
    kernels.set_isa(widest)


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


class Recorder:
    """Stands in for the runner's native step and records each call's slots."""

    def __init__(self, step: NativeDecodeStep) -> None:
        self.step = step
        self.calls: list[list[int]] = []

    def takes(self, num_tokens: list[int]) -> bool:
        return self.step.takes(num_tokens)

    def __call__(self, token_ids: list[int], positions: list[int], slots: list[int]) -> Any:
        self.calls.append(list(slots))
        return self.step(token_ids, positions, slots)

    def prefill_calls(self) -> list[list[int]]:
        return [slots for slots in self.calls if len(set(slots)) < len(slots)]

    def mixed_calls(self) -> list[list[int]]:
        """Calls with a prefill chunk and a decode row (a slot holding one row)."""
        return [
            slots for slots in self.prefill_calls() if any(slots.count(slot) == 1 for slot in slots)
        ]


def recording(engine: LLMEngine) -> Recorder:
    step = model_runner(engine).native_step
    assert step is not None and step.prefill, "the native step should take prefill chunks"
    # A stand-in with the step's call, not a NativeDecodeStep: what the runner calls is wrapped.
    model_runner(engine).native_step = recorder = Recorder(step)  # type: ignore[assignment]
    return recorder


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generated(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    seqs = run_staggered(engine, prompts, greedy(max_tokens), every=3, per=2)
    return [seq.generated_token_ids for seq in seqs]


# ---- the attention kernel: causal within the chunk, GQA, odd lengths ------------------------


def reference_attention(q, k_cache, v_cache, slots, lens, scale):
    """Row r: its query heads [kv_heads * group] against cache row slots[r], positions
    [0, lens[r]), query head h reading kv head h // group (transformers' repeat_kv)."""
    rows, kv_heads, group, d = q.shape
    out = torch.empty_like(q)
    for r in range(rows):
        keys = k_cache[slots[r], :, : lens[r]].repeat_interleave(group, dim=0)
        values = v_cache[slots[r], :, : lens[r]].repeat_interleave(group, dim=0)
        query = q[r].reshape(kv_heads * group, 1, d)
        out[r] = F.scaled_dot_product_attention(query, keys, values, scale=scale).reshape(
            kv_heads, group, d
        )
    return out


# d 20: not a multiple of 8, the plain C code row by row; the others take the blocks (rows of a
# chunk 32 at a time, four queries at once: 37 and 70 leave partial blocks and quads), 512 bits
# wide where the kernels run AVX-512 and d is a multiple of 16 (48 under one 64-wide pass of the
# values, 128 two), else two 8-wide vectors (40: a last pass of one vector; 24 on AVX-512 too).
@pytest.mark.parametrize("d", [64, 20, 48, 128, 40, 24])
@pytest.mark.parametrize(("start", "length"), [(0, 1), (0, 37), (13, 29), (50, 3), (5, 70)])
def test_chunk_attention_is_causal_over_the_slot_cache(kernels, isa, d, start, length):
    """A chunk of `length` rows in slot 1 from position `start` (earlier positions: a previous
    chunk or a prefix copy), next to a decode row of slot 2: each chunk row sees the positions
    up to its own, none after, as a causal SDPA over the chunk does."""
    torch.manual_seed(start * 100 + length + d)
    kv_heads, group, max_len = 3, 3, 96 if start + length < 96 else 128
    k_cache = torch.randn(3, kv_heads, max_len, d)
    v_cache = torch.randn(3, kv_heads, max_len, d)
    q = torch.randn(length + 1, kv_heads, group, d)
    slots = [1] * length + [2]
    lens = [start + i + 1 for i in range(length)] + [41]
    scale = 1.0 / math.sqrt(d)
    got = kernels.slot_attention(
        q, k_cache, v_cache, torch.tensor(slots), torch.tensor(lens), scale
    )
    expected = reference_attention(q, k_cache, v_cache, slots, lens, scale)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # The chunk's rows as one causal SDPA over [start + length) keys: the same thing.
    keys = k_cache[1, :, : start + length].repeat_interleave(group, dim=0)
    values = v_cache[1, :, : start + length].repeat_interleave(group, dim=0)
    queries = q[:length].permute(1, 2, 0, 3).reshape(kv_heads * group, length, d)
    mask = torch.ones(length, start + length, dtype=torch.bool).tril(diagonal=start)
    causal = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    causal = causal.reshape(kv_heads, group, length, d).permute(2, 0, 1, 3)
    torch.testing.assert_close(got[:length], causal, rtol=1e-4, atol=1e-5)


def test_chunks_of_two_slots_side_by_side_attend_to_their_own_rows(kernels, isa):
    """Two chunks back to back (slot 2 from position 0, slot 0 from 7), the second's first
    row right after the first's last: the blocks never cross from one to the other."""
    torch.manual_seed(3)
    kv_heads, group, d, max_len = 2, 2, 64, 64
    k_cache = torch.randn(3, kv_heads, max_len, d)
    v_cache = torch.randn(3, kv_heads, max_len, d)
    slots = [2] * 9 + [0] * 40
    lens = [i + 1 for i in range(9)] + [7 + i + 1 for i in range(40)]
    q = torch.randn(len(slots), kv_heads, group, d)
    got = kernels.slot_attention(
        q, k_cache, v_cache, torch.tensor(slots), torch.tensor(lens), 0.125
    )
    expected = reference_attention(q, k_cache, v_cache, slots, lens, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_slot_attention_refuses_slots_outside_the_cache(kernels):
    q, cache = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match="slots"):
        kernels.slot_attention(q, cache, cache, torch.tensor([0, 2]), torch.tensor([1, 1]), 1.0)


# ---- the engine: the tokens of the transformers path -----------------------------------------


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_chunked_prefill_gives_the_tokens_of_the_transformers_path(sharp_dir, isa, quantization):
    """Chunks of at most 16 tokens (prompts of 3-63 tokens cross 0-3 chunk boundaries), staggered
    arrivals so that decode rows and prefill chunks share steps."""
    prompts = make_prompts(8, seed=5)
    settings = {
        "max_batch_size": 3,
        "max_batched_tokens": 16,
        "linear_backend": "native",
        "quantization": quantization,
    }
    engine = make_engine(sharp_dir, **settings)
    recorder = recording(engine)
    native = generated(engine, prompts, 10)
    assert recorder.prefill_calls() and recorder.mixed_calls()
    plain = make_engine(sharp_dir, **settings)
    model_runner(plain).native_step = None  # every step through transformers
    assert native == generated(plain, prompts, 10)
    if quantization == "none":
        reference = AutoModelForCausalLM.from_pretrained(str(sharp_dir), dtype=torch.float32)
        reference.generation_config.eos_token_id = None
        assert native == [hf_greedy(reference.eval(), prompt, 10) for prompt in prompts]


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_mistral_and_qwen2_prefill_natively_with_the_tokens_of_generate(
    tmp_path, smollm2_dir, arch
):
    model_dir = build_sharp_tiny_model(tmp_path / arch, smollm2_dir, arch=arch)
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    engine = make_engine(
        model_dir, max_batch_size=3, max_batched_tokens=20, linear_backend="native"
    )
    recorder = recording(engine)
    prompts = make_prompts(5, seed=2)
    outputs = generated(engine, prompts, 8)
    assert recorder.prefill_calls()
    assert outputs == [hf_greedy(reference, prompt, 8) for prompt in prompts]


def test_the_tiny_model_prefills_natively_with_the_tokens_of_generate(tiny_model_dir):
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    engine = make_engine(
        tiny_model_dir, max_batch_size=2, max_batched_tokens=16, linear_backend="native"
    )
    recorder = recording(engine)
    prompts = make_prompts(4, seed=7)
    outputs = generated(engine, prompts, 8)
    assert recorder.prefill_calls()
    assert outputs == [hf_greedy(reference.eval(), prompt, 8) for prompt in prompts]


def test_prefix_cache_hits_prefill_from_mid_sequence(sharp_dir):
    """Prefills that start after a copied prefix (and chunks after it): the cache-off answer."""
    prompts = shared_prefix_prompts()
    settings = {"max_batch_size": 4, "max_batched_tokens": 24, "linear_backend": "native"}
    engine = make_engine(sharp_dir, enable_prefix_caching=True, **settings)
    recorder = recording(engine)
    with_cache = generated(engine, prompts, 12)
    assert engine.stats().prefix_cache_hits_total > 400
    assert recorder.prefill_calls()
    plain = make_engine(sharp_dir, enable_prefix_caching=False, **settings)
    model_runner(plain).native_step = None
    assert with_cache == generated(plain, prompts, 12)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_smollm2_prefill_natively_gives_the_tokens_of_the_transformers_path(
    smollm2_dir, quantization
):
    prompts = make_prompts(6, seed=11)
    settings = {
        "max_batch_size": 3,
        "max_batched_tokens": 40,
        "linear_backend": "native",
        "quantization": quantization,
    }
    engine = make_engine(smollm2_dir, **settings)
    recorder = recording(engine)
    native = generated(engine, prompts, 12)
    assert recorder.prefill_calls() and recorder.mixed_calls()
    model_runner(engine).native_step = None
    assert generated(engine, prompts, 12) == native


def test_prompt_logprobs_come_from_the_native_rows(sharp_dir):
    """A request asking for prompt logprobs prefills natively too: the hook reads every row."""
    prompt = make_prompts(6, seed=3)[5]  # 38 tokens: three chunks of 16
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    results = []
    for native in (True, False):
        engine = make_engine(
            sharp_dir, max_batch_size=2, max_batched_tokens=16, linear_backend="native"
        )
        if native:
            recorder = recording(engine)
        else:
            model_runner(engine).native_step = None
        (seq,) = run_staggered(engine, [prompt], params, every=1, per=1)
        assert seq.prompt_logprobs is not None and seq.prompt_logprobs[0] is None
        results.append((seq.prompt_logprobs[1:], seq.generated_token_ids))
    assert recorder.prefill_calls()
    (native_rows, native_tokens), (plain_rows, plain_tokens) = results
    assert native_tokens == plain_tokens
    assert len(native_rows) == len(prompt) - 1
    for a, b in zip(native_rows, plain_rows, strict=True):
        assert a is not None and b is not None
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


# ---- the step itself ---------------------------------------------------------------------------


def test_a_steady_state_prefill_allocates_nothing(sharp_dir, kernels):
    engine = make_engine(sharp_dir, max_batch_size=3, max_model_len=128, linear_backend="native")
    step = model_runner(engine).native_step
    assert step is not None
    # The widest step first (the workspace grows): a 37-token chunk, a 20-token one, a decode.
    step([*range(5, 62), 9], [*range(37), *range(20), 70], [0] * 37 + [1] * 20 + [2])

    def steps() -> None:
        for length in (37, 11, 29, 1):
            step(list(range(7, 7 + length)), list(range(40, 40 + length)), [1] * length)
        step(list(range(5, 45)), [*range(20), *range(20)], [0] * 20 + [2] * 20)

    before = kernels.fallback_allocations()
    steps()
    assert kernels.fallback_allocations() == before


def test_rows_at_one_slot_and_position_are_refused(sharp_dir):
    engine = make_engine(sharp_dir, max_batch_size=2, max_model_len=64, linear_backend="native")
    step = model_runner(engine).native_step
    assert step is not None
    with pytest.raises(ValueError, match="same slot and position"):
        step([5, 6, 7], [3, 4, 3], [1, 1, 1])


def test_prefill_off_keeps_prefill_chunks_on_the_transformers_path(sharp_dir):
    engine = make_engine(sharp_dir, max_batch_size=2, linear_backend="native")
    step = model_runner(engine).native_step
    assert step is not None and step.takes([1, 7]) and step.takes([1, 1])
    step.prefill = False
    assert not step.takes([1, 7]) and step.takes([1, 1])
    assert not step.takes([1] * (step.max_rows + 1))  # wide decode steps: aten's products
