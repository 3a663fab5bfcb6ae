"""Turn the last-position logits of a step into one token per sequence (greedy, top-k, top-p).

Sampling is total: every row gets a token or a :class:`SequenceError` of its own, and no row's
trouble reaches another. A row whose logits are not usable (NaN or +inf anywhere, or all -inf)
never reaches ``torch.multinomial``; temperatures below ``GREEDY_TEMPERATURE_EPSILON`` are
greedy (see :mod:`slotserve.engine.params`), and sampled rows are shifted by their maximum
before dividing by the temperature, so no finite row can overflow.
"""

from __future__ import annotations

import secrets

import torch

from slotserve.engine.params import SamplingParams
from slotserve.engine.sequence import SequenceError

NON_FINITE_LOGITS = SequenceError(
    "non_finite_logits", "the model produced non-finite logits (NaN or inf) for this request"
)


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
) -> list[int | SequenceError]:
    """``logits`` is ``[B, vocab]``; row ``i`` is sampled with ``params[i]``/``generators[i]``.

    Returns, per row, the token or why that row has none.
    """
    # One pass gives the greedy tokens and the check: max propagates NaN, so a row is usable
    # exactly when its maximum is finite (costs nothing over the argmax it replaces).
    row_max, greedy_t = logits.max(dim=-1)
    usable = torch.isfinite(row_max).tolist()
    greedy = greedy_t.tolist()
    samples: list[int | SequenceError] = []
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if not usable[row]:
            samples.append(NON_FINITE_LOGITS)
        elif row_params.is_greedy:
            samples.append(greedy[row])
        elif generator is None:
            raise ValueError("a sampled (temperature > 0) row needs a generator")
        else:
            samples.append(_sample_row_safely(logits[row], row_params, generator))
    return samples


def _sample_row_safely(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> int | SequenceError:
    try:
        return _sample_row(logits, params, generator)
    except Exception as error:  # e.g. multinomial on invalid probabilities: this row only
        return SequenceError("sampling", f"sampling failed: {type(error).__name__}")


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    scores = logits.float()
    # Shifted so the maximum is 0: dividing by any temperature > 0 then gives values <= 0 (at
    # worst -inf), never +inf or NaN, and softmax is unchanged by the shift.
    scores = (scores - scores.max()) / params.temperature
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
