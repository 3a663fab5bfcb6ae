"""bench/quant_quality.py: teacher-forced agreement and perplexity between two models."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.lib.quality import DEFAULT_TEXT, compare, evaluate, score, text_token_ids, windows

VOCAB = 1000


def tiny_llama(max_positions: int = 256) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Spread the logits, so the argmax is a decision rather than float noise.
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def token_ids(num: int) -> list[int]:
    return torch.randint(0, VOCAB, (num,), generator=torch.Generator().manual_seed(1)).tolist()


def test_windows_cover_the_text_without_overlap() -> None:
    assert windows(600, 256) == [(0, 256), (256, 512), (512, 600)]
    assert windows(513, 256) == [(0, 256), (256, 512)]  # a 1-token tail predicts nothing


def test_identical_models_agree_everywhere() -> None:
    reference = tiny_llama()
    result = evaluate(reference, copy.deepcopy(reference), token_ids(600), window=256)
    assert result.top1_agreement == 1.0
    assert result.perplexity_increase == pytest.approx(0.0, abs=1e-12)
    assert result.num_tokens == 600
    assert result.num_predictions == 600 - 3  # three windows, each first token unpredicted
    assert result.reference_perplexity == result.candidate_perplexity


def test_a_perturbed_copy_disagrees_and_has_a_finite_perplexity() -> None:
    reference = tiny_llama()
    candidate = copy.deepcopy(reference)
    torch.manual_seed(2)
    with torch.no_grad():
        for parameter in candidate.parameters():
            parameter.add_(0.05 * parameter.std() * torch.randn_like(parameter))
    result = evaluate(reference, candidate, token_ids(600), window=256)
    assert 0.0 < result.top1_agreement < 1.0
    assert math.isfinite(result.candidate_perplexity)
    assert result.perplexity_increase != 0.0
    assert result.passes("fp16") is None  # no threshold for modes the issue does not name


def test_stepped_scores_match_the_full_forward_pass() -> None:
    """Fed a step at a time with the KV cache carried, NLL and argmax equal Hugging Face's own
    loss and logits over the whole window in one pass (no seams between steps)."""
    model = tiny_llama(max_positions=512)
    ids = token_ids(300)  # one window, 10 steps of 32 (the last one short)
    scores = score(model, ids, window=512, step=32)
    with torch.inference_mode():
        tensor = torch.tensor([ids])
        out = model(input_ids=tensor, labels=tensor)
    assert scores.nll.shape == (299,)
    assert scores.perplexity == pytest.approx(math.exp(out.loss.item()), rel=1e-5)
    assert torch.equal(scores.argmax, out.logits[0, :-1].argmax(-1))


def test_readings_of_different_setups_are_not_compared() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="different"):
        compare(score(model, token_ids(100), step=32), score(model, token_ids(100), step=16))


def test_windows_never_exceed_the_models_positions() -> None:
    model = tiny_llama(max_positions=64)
    result = evaluate(model, model, token_ids(200), window=1024)
    assert result.window == 64
    assert result.num_predictions == 200 - 4  # windows of 64, 64, 64, 8


def test_the_shipped_text_holds_2000_smollm2_tokens(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    ids = text_token_ids(AutoTokenizer.from_pretrained(str(smollm2_dir)), DEFAULT_TEXT)
    assert len(ids) >= 2000


def test_int8_groups_round_each_group_on_its_own_grid_once():
    from bench.lib.kv_simulate import int8_groups

    torch.manual_seed(3)
    x = torch.randn(2, 3, 5, 64) * torch.tensor([0.01, 1.0, 100.0]).view(1, 3, 1, 1)
    x[0, 0, 0] = 0.0  # an all-zero group stays zero (no 0 / 0)
    rounded = int8_groups(x, 32)
    groups = x.reshape(2, 3, 5, 2, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    error = (rounded.reshape(groups.shape) - groups).abs()
    # Half a step, plus the fp16 scale's own rounding (2^-11 relative) over 127 steps.
    assert (error <= step * (0.5 + 127 * 2**-11)).all()
    assert torch.equal(rounded[0, 0, 0], torch.zeros(64))
    assert torch.equal(int8_groups(rounded, 32), rounded)  # rounding twice is rounding once


def test_a_simulated_kv_cache_changes_the_reading_only_while_it_is_open():
    from bench.lib.kv_simulate import simulated_kv

    model = tiny_llama()
    ids = token_ids(96)
    before = score(model, ids, window=96, step=32)
    with simulated_kv("int8-keys"):
        coarse = score(model, ids, window=96, step=32)
    after = score(model, ids, window=96, step=32)
    assert torch.equal(before.nll, after.nll)
    assert not torch.equal(before.nll, coarse.nll)
    assert (before.nll - coarse.nll).abs().max() < 0.1  # rounded, not broken
