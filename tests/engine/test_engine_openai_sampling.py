"""The batched sampler's masks and draws against plain per-row references."""

from __future__ import annotations

import torch

from slotserve.engine.core.model.sampling import _top_k_top_p, sample
from slotserve.engine.core.params import SamplingParams


def reference_row(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """HF's order, one row, full sorts: top_k, then top_p over the renormalised rest."""
    scores = scores.clone()
    if top_k:
        kth = scores.topk(top_k).values[-1]
        scores[scores < kth] = float("-inf")
    if top_p < 1.0:
        ordered, order = scores.sort(descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        ordered[drop] = float("-inf")
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, ordered)
    return scores


def test_top_k_top_p_equal_full_sorts_also_for_flat_rows():
    torch.manual_seed(0)
    sharp = torch.randn(6, 5000) * 4
    flat = torch.randn(3, 5000) * 0.01  # the nucleus is far wider than the 256 candidates
    middling = torch.randn(2, 5000) * 1.2  # wider than 256, within 2048
    scores = torch.cat([sharp, flat, middling])
    top_k = [0, 5, 0, 40, 300, 0, 0, 0, 10, 0, 0]
    top_p = [0.9, 1.0, 0.5, 0.8, 0.95, 1.0, 0.9, 0.3, 0.99, 0.9, 0.6]
    got = _top_k_top_p(scores, top_k, top_p)
    for row in range(scores.shape[0]):
        expected = reference_row(scores[row], top_k[row], top_p[row])
        assert torch.equal(torch.isinf(got[row]), torch.isinf(expected)), row
        kept = ~torch.isinf(expected)
        assert torch.equal(got[row][kept], scores[row][kept]), row


def test_draws_follow_the_distribution_and_seeds_repeat_in_any_batch():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    shared = torch.Generator().manual_seed(0)
    tokens = sample(logits, params, [None] * 4000, shared).tokens
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float() / 4000
    assert counts[4] == 0, "a token of probability 0 is never drawn"
    assert torch.allclose(counts, probs, atol=0.03)

    def seeded(num_others: int) -> int:
        row = torch.linspace(-1, 1, 50).unsqueeze(0)
        scores = torch.cat([torch.randn(num_others, 50), row])
        p = [SamplingParams(temperature=1.0)] * num_others + [
            SamplingParams(temperature=1.0, seed=7)
        ]
        gens = [None] * num_others + [torch.Generator().manual_seed(7)]
        token = sample(scores, p, gens, torch.Generator().manual_seed(num_others)).tokens[-1]
        assert isinstance(token, int)  # a sampled token, not the row's failure
        return token

    assert seeded(0) == seeded(4) == seeded(16)
