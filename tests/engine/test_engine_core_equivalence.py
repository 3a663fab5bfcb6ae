"""Greedy outputs under continuous batching equal HF generate() on each prompt alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from slotserve.engine.core.params import SamplingParams
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    hf_greedy,
    make_engine,
    make_prompts,
    run_staggered,
)

NUM_NEW = 24


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


@pytest.fixture(scope="module")
def reference_model(sharp_model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(sharp_model_dir), dtype=torch.float32).eval()
    # Like ignore_eos in the engine: neither stop at nor suppress the end-of-sequence token.
    model.generation_config.eos_token_id = None
    return model


def test_outputs_vary_so_equivalence_means_something(reference_model):
    out = hf_greedy(reference_model, make_prompts(1)[0], 12)
    assert len(set(out)) > 6


# aten: PyTorch's own products; onednn: packed weights and fused MLPs (core/model/linear.py),
# which "auto" picks for larger models; tiny test models would otherwise never exercise them.
LINEAR_BACKENDS = ["aten", "onednn"]


@pytest.mark.parametrize("linear_backend", LINEAR_BACKENDS)
def test_continuous_batching_equals_generate_with_staggered_arrivals_and_preemption(
    sharp_model_dir, reference_model, linear_backend
):
    prompts = make_prompts(18)
    # 6 slots, a KV budget that cannot hold 6 growing sequences, 32 tokens per step: long
    # prompts are chunked, decodes grow past the budget and the newest get preempted.
    engine = make_engine(
        sharp_model_dir,
        max_batch_size=6,
        max_batched_tokens=32,
        kv_cache_tokens=260,
        linear_backend=linear_backend,
    )
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    seqs = run_staggered(engine, prompts, params, every=5, per=3)
    assert engine.stats().num_preemptions > 0
    assert any(seq.num_preemptions for seq in seqs)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.finish_reason == "length"
        assert seq.generated_token_ids == hf_greedy(reference_model, prompt, NUM_NEW), (
            seq.request_id
        )


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_static_and_dynamic_policies_equal_generate(sharp_model_dir, reference_model, policy):
    prompts = make_prompts(6, seed=1)
    engine = make_engine(
        sharp_model_dir, policy=policy, max_batch_size=4, max_queue_delay_microseconds=0
    )
    results = engine.generate(
        prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    for result, prompt in zip(results, prompts, strict=True):
        assert result.token_ids == hf_greedy(reference_model, prompt, 10)


@pytest.mark.parametrize("linear_backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "gemma", "phi3"])
def test_other_decoder_families_equal_generate(tmp_path_factory, smollm2_dir, arch, linear_backend):
    model_dir = build_sharp_tiny_model(
        tmp_path_factory.getbasetemp() / f"sharp-{arch}", smollm2_dir, arch=arch
    )
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    prompts = make_prompts(5, seed=2)
    engine = make_engine(
        model_dir, max_batch_size=3, max_batched_tokens=24, linear_backend=linear_backend
    )
    results = engine.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    for result, prompt in zip(results, prompts, strict=True):
        assert result.token_ids == hf_greedy(reference, prompt, 8), arch
