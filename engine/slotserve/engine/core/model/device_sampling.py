"""Sampling inside the static decode step: fixed shapes, no host round trip, one result tensor.

The same rules as :mod:`slotserve.engine.core.model.sampling` (the penalties of
:mod:`device_penalties`, temperature after a shift by the row's
maximum, ``top_k`` then ``top_p`` renormalised over the kept tokens, then ``min_p``, an inverse-CDF
draw, vLLM's processed logprobs), written for a captured graph: every row runs every operation
(a greedy row's masks are identities: ``top_k`` 0, ``top_p`` 1, ``min_p`` 0, temperature 1), the
masks work on one full sort of each row instead of ``topk`` tiers chosen on the host, and Python
never reads a value.

Random numbers come from a counter-based hash of the row's seed and the token's position, not
from a ``torch.Generator`` (a generator's state lives on the host and cannot advance inside a
graph): a seeded request draws the same tokens alone or in any batch, and again after a
preemption, but not the same tokens as the eager sampler for the same seed.

Result columns: token, usable (0 when the raw logits hold NaN or +inf, or are all -inf), then in
the full mode the token's logprob, the ``num_top`` best ids and their logprobs.
"""

from __future__ import annotations

import torch

from slotserve.engine.core.model.device_penalties import count_and_apply
from slotserve.engine.core.model.static_buffers import (
    BAN_EOS,
    FLAGS,
    GREEDY,
    MIN_P,
    POSITION,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)

MASK32 = 0xFFFFFFFF
# Draws are at least this, so a token of probability 0 (cdf equal to its predecessor's) is never
# found; the eager sampler uses the same floor.
MIN_UNIFORM = 1e-7


def seed_column(seed: int) -> int:
    """A request's seed folded to the 32 bits the hash mixes."""
    return (seed ^ (seed >> 32)) & MASK32


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One number in [0, 1) per row from (seed, position): a 32-bit integer hash. Multipliers
    stay below 2**31 so no int64 product overflows."""
    x = (seeds ^ ((positions * 0x1E3779B1) & MASK32)) & MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & MASK32
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


def greedy_result(logits: torch.Tensor) -> torch.Tensor:
    """``[rows, 2]``: the argmax and whether the row is usable."""
    raw = logits.float()
    usable = torch.isfinite(raw.amax(dim=-1))
    return torch.stack([raw.argmax(dim=-1).to(torch.float32), usable.to(torch.float32)], dim=1)


def full_result(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    eos_mask: torch.Tensor,
    prompt_seen: torch.Tensor,
    output_counts: torch.Tensor,
    num_top: int,
) -> torch.Tensor:
    """``[rows, 3 + 2 * num_top]``: every row sampled by its own parameters (see module doc);
    the penalties count each row's input token (``tokens``) in ``output_counts`` first."""
    raw = logits.float()
    vocab_size = raw.shape[1]
    usable = torch.isfinite(raw.amax(dim=-1))
    scores = raw.masked_fill(~usable.unsqueeze(1), 0.0)
    scores = count_and_apply(scores, tokens, ints, floats, prompt_seen, output_counts)
    flags = ints[FLAGS]
    ban = (flags & BAN_EOS) != 0
    scores = scores.masked_fill(ban.unsqueeze(1) & eos_mask.unsqueeze(0), float("-inf"))
    greedy = (flags & GREEDY) != 0
    temperature = floats[TEMPERATURE].to(torch.float32)
    scaled = (scores - scores.amax(dim=-1, keepdim=True)) / temperature.unsqueeze(1)

    values, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab_size, device=raw.device).unsqueeze(0)
    top_k = ints[TOP_K]
    keep_k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    values = values.masked_fill(rank >= keep_k.unsqueeze(1), float("-inf"))
    top_p = floats[TOP_P].to(torch.float32).unsqueeze(1)
    probs = values.softmax(dim=-1)
    # The smallest set of best tokens whose mass reaches top_p (always the best one); rows at 1
    # skip it, as a cumulative sum may round a tail token's mass-before up to 1.
    keep_p = ((probs.cumsum(dim=-1) - probs) < top_p) | (rank == 0) | (top_p >= 1.0)
    values = values.masked_fill(~keep_p, float("-inf"))
    probs = values.softmax(dim=-1)
    min_p = floats[MIN_P].to(torch.float32).unsqueeze(1)
    values = values.masked_fill(probs < min_p * probs[:, :1], float("-inf"))

    cdf = values.softmax(dim=-1).cumsum(dim=-1)
    draw = uniform(ints[SEED], ints[POSITION]).clamp(min=MIN_UNIFORM)
    target = draw.unsqueeze(1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, target).clamp(max=vocab_size - 1)
    drawn = order.gather(1, index).squeeze(1)
    token = torch.where(greedy, scores.argmax(dim=-1), drawn)

    logprobs = values.log_softmax(dim=-1)  # sorted order: the best num_top lead
    by_token = torch.empty_like(logprobs).scatter_(1, order, logprobs)
    chosen = by_token.gather(1, token.unsqueeze(1))
    return torch.cat(
        [
            token.to(torch.float32).unsqueeze(1),
            usable.to(torch.float32).unsqueeze(1),
            chosen,
            order[:, :num_top].to(torch.float32),
            logprobs[:, :num_top],
        ],
        dim=1,
    )
