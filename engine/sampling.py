"""Turn the last-position logits of a step into one token per sequence (greedy, top-k, top-p)."""

from __future__ import annotations

import secrets

import torch

from slotserve.engine.params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """A per-request generator: seeded requests draw the same tokens whatever their batch."""
    generator = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    generator.manual_seed(seed % (1 << 63))
    return generator


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """``logits`` is ``[B, vocab]``; row ``i`` is sampled with ``params[i]``/``generators[i]``."""
    greedy = logits.argmax(dim=-1).tolist()
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if row_params.is_greedy:
            continue
        if generator is None:
            raise ValueError("a sampled (temperature > 0) row needs a generator")
        greedy[row] = _sample_row(logits[row], row_params, generator)
    return greedy


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    scores = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop = cumulative - sorted_scores.softmax(dim=-1) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
