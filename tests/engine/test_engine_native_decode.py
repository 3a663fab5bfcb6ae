"""Decode steps in one native call (model/native_decode.py, kernels/llama_step.c): the same hidden
states and tokens as the transformers path, on the AVX2 code and the plain C one, for fp32, int8
and int4 weights, and no native step where the model is not one it computes exactly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.kernels import load_kernels
from slotserve.engine.core.model.native_decode import NativeDecodeStep
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.scheduler import ScheduledChunk
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    hf_greedy,
    make_engine,
    make_prompts,
    model_runner,
    run_staggered,
)

NUM_NEW = 20


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


@pytest.fixture(params=[True, False], ids=["avx2", "plain_c"])
def isa(request) -> Iterator[bool]:
    kernels = load_kernels(CommonSettings().home)
    if request.param and not kernels.set_avx2(True):
        pytest.skip("this CPU has no AVX2/FMA")
    kernels.set_avx2(request.param)
    yield request.param
    kernels.set_avx2(True)


class CountingStep:
    """Stands in for the runner's native step and counts the steps it ran."""

    def __init__(self, step: NativeDecodeStep) -> None:
        self.step = step
        self.max_rows = step.max_rows
        self.rows: list[int] = []

    def takes(self, num_tokens: list[int]) -> bool:
        return self.step.takes(num_tokens)

    def __call__(self, *args: Any) -> torch.Tensor:
        self.rows.append(len(args[0]))
        return self.step(*args)


def counting(engine: LLMEngine) -> CountingStep:
    step = model_runner(engine).native_step
    assert step is not None, "the native step should serve this model"
    # A stand-in with the step's call, not a NativeDecodeStep: what the runner calls is wrapped.
    model_runner(engine).native_step = counter = CountingStep(step)  # type: ignore[assignment]
    return counter


def test_native_steps_equal_generate_with_staggered_arrivals_and_preemption(sharp_dir, isa):
    reference = AutoModelForCausalLM.from_pretrained(str(sharp_dir), dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    prompts = make_prompts(12)
    engine = make_engine(
        sharp_dir,
        max_batch_size=6,
        max_batched_tokens=32,
        kv_cache_tokens=260,
        linear_backend="native",
    )
    counter = counting(engine)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    seqs = run_staggered(engine, prompts, params, every=5, per=3)
    assert engine.stats().num_preemptions > 0
    # Decode-only steps of 1 to 6 rows ran natively, and so did steps with prefill chunks.
    assert len(counter.rows) > NUM_NEW and max(counter.rows) > 1
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.generated_token_ids == hf_greedy(reference, prompt, NUM_NEW), seq.request_id


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_hidden_states_equal_the_transformers_path(sharp_dir, isa, quantization):
    """The same decode rows (slots out of order, different lengths) through both paths."""
    engine = make_engine(
        sharp_dir, max_batch_size=6, linear_backend="native", quantization=quantization
    )
    runner = model_runner(engine)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(5, seed=3)
    seqs = [engine.add_request(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
    for _ in range(4):
        engine.step()
    engine.abort("r1")  # a hole among the slots
    engine.step()
    live = [seq for seq in seqs if seq.slot is not None][::-1]
    assert len(live) == 4 and all(seq.num_tokens - seq.num_computed_tokens == 1 for seq in live)
    chunks = [ScheduledChunk(seq, seq.num_computed_tokens, 1, True) for seq in live]
    native, sample_index = runner._native_decode(chunks)
    with torch.inference_mode():
        hidden, torch_index = runner._transformers_forward(chunks)
    assert sample_index == torch_index == [0, 1, 2, 3]
    torch.testing.assert_close(native, hidden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_smollm2_native_steps_give_the_tokens_of_the_transformers_path(smollm2_dir, quantization):
    engine = make_engine(
        smollm2_dir, max_batch_size=4, linear_backend="native", quantization=quantization
    )
    prompts = make_prompts(4, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    counter = counting(engine)
    native = [
        seq.generated_token_ids for seq in run_staggered(engine, prompts, params, every=3, per=2)
    ]
    assert counter.rows
    model_runner(engine).native_step = None
    plain = [
        seq.generated_token_ids for seq in run_staggered(engine, prompts, params, every=3, per=2)
    ]
    assert native == plain


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_mistral_and_qwen2_steps_run_natively_with_the_tokens_of_generate(
    tmp_path, smollm2_dir, arch
):
    """Their layers compute what Llama's do (Qwen2 with a q/k/v bias)."""
    model_dir = build_sharp_tiny_model(tmp_path / arch, smollm2_dir, arch=arch)
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    engine = make_engine(model_dir, max_batch_size=3, linear_backend="native")
    counter = counting(engine)
    prompts = make_prompts(5, seed=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seqs = run_staggered(engine, prompts, params, every=3, per=2)
    assert max(counter.rows) > 1
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.generated_token_ids == hf_greedy(reference, prompt, 12), seq.request_id


def test_a_context_past_the_sliding_window_is_refused_at_load(tmp_path, smollm2_dir):
    """The slot attention reads the whole row: past the window it would answer differently."""
    model_dir = build_sharp_tiny_model(
        tmp_path / "window", smollm2_dir, arch="mistral", config={"sliding_window": 32}
    )
    with pytest.raises(UnsupportedSettingError, match=r"sliding attention window \(32\)"):
        make_engine(model_dir, max_batch_size=1, max_model_len=64)
    engine = make_engine(model_dir, max_batch_size=1, max_model_len=32, linear_backend="native")
    assert model_runner(engine).native_step is not None


@pytest.mark.parametrize(
    ("arch", "backend"), [("qwen3", "native"), ("gemma", "native"), ("llama", "aten")]
)
def test_no_native_step_where_the_model_or_layers_differ(tmp_path, smollm2_dir, arch, backend):
    """Other architectures (Qwen3's q/k norms, Gemma's GELU and scaled norms) and stock layers
    run through transformers, with the same answers as generate()."""
    model_dir = build_sharp_tiny_model(tmp_path / arch, smollm2_dir, arch=arch)
    engine = make_engine(model_dir, max_batch_size=2, linear_backend=backend)
    assert model_runner(engine).native_step is None
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    prompt = make_prompts(1)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (seq,) = run_staggered(engine, [prompt], params, every=1, per=1)
    assert seq.generated_token_ids == hf_greedy(reference, prompt, 8)


def test_rows_outside_the_cache_are_refused(sharp_dir):
    engine = make_engine(sharp_dir, max_batch_size=2, max_model_len=64, linear_backend="native")
    step = model_runner(engine).native_step
    assert step is not None
    with pytest.raises(ValueError, match="same slot"):
        step([5, 6], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="outside the cache"):
        step([5], [64], [0])
    with pytest.raises(ValueError, match="outside the cache"):
        step([5], [0], [2])
