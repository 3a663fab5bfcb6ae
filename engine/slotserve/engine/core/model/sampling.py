"""Turn the last-position logits of a step into one token per sequence, batched.

The pipeline runs on the whole ``[rows, vocab]`` tensor: ``min_tokens``, ``logit_bias`` and the
penalties (:mod:`slotserve.engine.core.model.penalties`), the temperature (greedy rows keep
theirs at 1), ``top_k`` / ``top_p`` / ``min_p`` masks, then a draw per row. Python only builds
the per-row parameter columns and reads the results back.

Draws invert each row's CDF with one uniform number: rows without a ``seed`` share one
generator and one call, a seeded row draws its number from its own generator, so a seeded
request gives the same tokens alone or in any batch. (vLLM's exponential race, ``argmax(probs /
q)``, needs a random number per vocabulary entry: 9 ms at batch 8 on this CPU.)

Sampling is total: every row gets a token or a :class:`SequenceError` of its own. A row whose raw
logits are not usable (NaN or +inf anywhere, or all -inf) gets ``non_finite_logits``;
temperatures below ``GREEDY_TEMPERATURE_EPSILON`` are greedy; rows are shifted by their maximum
before the temperature divides them, so no finite row can overflow. Should the batched draw
raise, each row is drawn alone so that only the row at fault fails.

Logprobs follow vLLM's ``processed_logprobs`` (see :mod:`slotserve.engine.core.logprobs`).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from slotserve.engine.core.logprobs import SampledLogprobs
from slotserve.engine.core.model.penalties import PenaltyState, process_logits
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.sequence import SequenceError

if TYPE_CHECKING:
    from slotserve.engine.core.sequence import Sequence

# top_p looks for its cut among this many best tokens first (see _top_k_top_p).
TOP_P_CANDIDATES = 256

GRAMMAR_REJECTED = SequenceError("sampling", "the structured-output grammar rejected the token")

NON_FINITE_LOGITS = SequenceError(
    "non_finite_logits", "the model produced non-finite logits (NaN or inf) for this request"
)


@dataclass
class SampleResult:
    """Per row: the token (or why there is none) and, if asked for, its logprobs."""

    tokens: list[int | SequenceError]
    logprobs: list[SampledLogprobs | None]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """A per-request generator: seeded requests draw the same tokens whatever their batch."""
    generator = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    generator.manual_seed(seed % (1 << 63))
    return generator


class Sampler:
    """The runner's sampler: penalty state per slot and the generator of unseeded rows."""

    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        device: torch.device,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.penalties = PenaltyState(num_slots, vocab_size, device)
        self.shared_generator = make_generator(SamplingParams(), device)

    def sample(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> SampleResult:
        """Row ``i`` of ``logits`` (``[rows, vocab]``) is sampled for ``seqs[i]``."""
        params = [seq.params for seq in seqs]
        for seq in seqs:
            if seq.generator is None and seq.params.seed is not None:
                seq.generator = make_generator(seq.params, self.device)
        scores = logits.float()
        structured = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
        if structured:
            scores = apply_grammars(scores, [seqs[row].matcher for row in structured], structured)
        scores = process_logits(scores, seqs, self.penalties, self.eos_token_ids)
        result = sample(
            scores, params, [seq.generator for seq in seqs], self.shared_generator, raw=logits
        )
        for row in structured:
            token = result.tokens[row]
            if isinstance(token, int) and not seqs[row].matcher.consume_token(token):
                result.tokens[row] = GRAMMAR_REJECTED  # the mask allowed it: a grammar bug
        return result


def apply_grammars(scores: torch.Tensor, matchers: list[Any], rows: list[int]) -> torch.Tensor:
    """``scores`` with each grammar row's disallowed tokens at -inf (a copy; one bitmask for
    all structured rows, filled by the matchers, applied in one call)."""
    import llguidance.torch

    vocab_size = scores.shape[1]
    bitmask = llguidance.torch.allocate_token_bitmask(len(rows), vocab_size)
    for i, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, i)
    index = torch.tensor(rows, device=scores.device)
    masked = scores.index_select(0, index).contiguous()
    llguidance.torch.apply_token_bitmask_inplace(masked, bitmask.to(scores.device))
    return scores.index_copy(0, index, masked)


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int | SequenceError]:
    """The tokens of :func:`sample` for logits that need no penalties (tests, benchmarks)."""
    shared = make_generator(SamplingParams(), logits.device)
    return sample(logits.float(), params, generators, shared).tokens


def sample(
    scores: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator,
    raw: torch.Tensor | None = None,
) -> SampleResult:
    """Sample every row of the processed ``scores``; ``raw`` (default: ``scores``) are the model's
    own logits, whose maximum says whether a row is usable."""
    # One pass over the raw logits tells the usable rows: max propagates NaN.
    row_max = (scores if raw is None else raw).amax(dim=-1)
    usable_t = torch.isfinite(row_max)
    usable = usable_t.tolist()
    if not all(usable):  # rare: keep NaN out of the batched ops; these rows get no token
        scores = scores.masked_fill(~usable_t.unsqueeze(1), 0.0)
    try:
        tokens, logprobs = _draw(scores, params, generators, shared)
    except Exception:  # e.g. a row's values break a kernel: find the row by drawing one by one
        tokens, logprobs = [], []
        for row in range(scores.shape[0]):
            try:
                one = _draw(
                    scores[row : row + 1], params[row : row + 1], generators[row : row + 1], shared
                )
            except Exception as error:
                tokens.append(SequenceError("sampling", f"sampling failed: {type(error).__name__}"))
                logprobs.append(None)
            else:
                tokens.extend(one[0])
                logprobs.extend(one[1])
    results: list[int | SequenceError] = [
        token if ok else NON_FINITE_LOGITS for token, ok in zip(tokens, usable, strict=True)
    ]
    return SampleResult(
        results, [lp if ok else None for lp, ok in zip(logprobs, usable, strict=True)]
    )


def _draw(
    scores: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator,
) -> tuple[list[int | SequenceError], list[SampledLogprobs | None]]:
    num_rows, vocab_size = scores.shape
    greedy = [p.is_greedy for p in params]
    wants_logprobs = [p.logprobs is not None for p in params]
    if all(greedy) and not any(wants_logprobs):
        return scores.argmax(dim=-1).tolist(), [None] * num_rows  # the common greedy step
    device = scores.device

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=scores.dtype, device=device).unsqueeze(1)

    # Shifted so each row's maximum is 0: any temperature > 0 then gives values <= 0 (at worst
    # -inf), never +inf or NaN; softmax and argmax are unchanged by the shift.
    temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    if any(t != 1.0 for t in temperatures):  # at 1 everywhere, the shift and division are no-ops
        scores = (scores - scores.amax(dim=-1, keepdim=True)) / column(temperatures)

    # Masks apply to sampled rows only (a greedy row's choice and logprobs ignore them).
    top_k = [
        p.top_k if not g and p.top_k and p.top_k < vocab_size else 0
        for p, g in zip(params, greedy, strict=True)
    ]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
    min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
    if any(top_k) or any(value < 1.0 for value in top_p):
        scores = _top_k_top_p(scores, top_k, top_p)
    if any(min_p):
        probs = scores.softmax(dim=-1)
        threshold = column(min_p) * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < threshold, float("-inf"))

    chosen = scores.argmax(dim=-1)
    if not all(greedy):
        # Inverse CDF: one uniform per row (shared generator in one call; a seeded row's own).
        cdf = scores.softmax(dim=-1).cumsum(dim=-1)
        uniform = torch.rand(num_rows, generator=shared, device=device)
        for row, generator in enumerate(generators):
            if generator is not None and not greedy[row]:
                uniform[row] = torch.rand(1, generator=generator, device=device)[0]
        # > 0, so a token of probability 0 (its cdf equals its predecessor's) is never found.
        target = uniform.clamp(min=1e-7).to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, target).squeeze(1).clamp(max=vocab_size - 1)
        chosen = torch.where(torch.tensor(greedy, device=device), chosen, drawn)
    tokens: list[int | SequenceError] = list(chosen.tolist())
    return tokens, _logprobs(scores, chosen, params, wants_logprobs)


def _top_k_top_p(
    scores: torch.Tensor, top_k: list[int], top_p: list[float], tier: int = 0
) -> torch.Tensor:
    """Keep each row's ``top_k`` best tokens (0: all), then the smallest set of best tokens
    whose mass reaches ``top_p`` (always the best one), as HF and vLLM do.

    A full sort of SmolLM2's vocabulary costs ~8 ms a row on this CPU, so the cut is looked for
    among the best ``TOP_P_CANDIDATES`` (one ``topk``, ~0.2 ms a row), for rows whose nucleus is
    wider among 8 times as many, and only then by a full sort.
    """
    num_rows, vocab_size = scores.shape
    device = scores.device
    wants_p = [value < 1.0 for value in top_p]
    num_candidates = min(
        vocab_size, max([*top_k, TOP_P_CANDIDATES * 8**tier if any(wants_p) else 1])
    )
    best = scores.topk(num_candidates, dim=-1).values  # descending
    has_k = torch.tensor([bool(k) for k in top_k], device=device)
    keep = torch.tensor([min(k, num_candidates) or num_candidates for k in top_k], device=device)
    needs_sort = torch.zeros(num_rows, dtype=torch.bool, device=device)
    if any(wants_p):
        p = torch.tensor(top_p, dtype=scores.dtype, device=device).unsqueeze(1)
        in_k = torch.arange(num_candidates, device=device).unsqueeze(0) < keep.unsqueeze(1)
        kept = best.masked_fill(~in_k, float("-inf"))
        # Masses after top_k: renormalised over the k kept for rows with top_k.
        normaliser = torch.where(has_k, kept.logsumexp(dim=-1), scores.logsumexp(dim=-1))
        probs = (kept - normaliser.unsqueeze(1)).exp()
        mass = probs.cumsum(dim=-1)
        num_nucleus = ((mass - probs) < p).sum(dim=-1).clamp(min=1)
        wants_p_t = torch.tensor(wants_p, device=device)
        covered = has_k | (mass[:, -1:] >= p).squeeze(1)
        keep = torch.where(wants_p_t & covered, torch.minimum(keep, num_nucleus), keep)
        needs_sort = wants_p_t & ~covered
    cut = has_k | (torch.tensor(wants_p, device=device) & ~needs_sort)
    threshold = best.gather(1, (keep - 1).unsqueeze(1))
    scores = scores.masked_fill((scores < threshold) & cut.unsqueeze(1), float("-inf"))
    if bool(needs_sort.any()):
        rows = needs_sort.nonzero().squeeze(1)
        if tier == 0:  # no top_k on these rows (else they would be covered): top_p alone
            wider = [top_p[row] for row in rows.tolist()]
            scores[rows] = _top_k_top_p(scores[rows], [0] * len(wider), wider, tier=1)
        else:
            p_rows = torch.tensor(top_p, dtype=scores.dtype, device=device)[rows].unsqueeze(1)
            scores[rows] = _top_p_sorted(scores[rows], p_rows)
    return scores


def _top_p_sorted(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p over whole rows, by a full sort."""
    ascending, order = scores.sort(dim=-1)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = mass_below <= 1.0 - top_p
    drop[:, -1] = False
    return scores.scatter(1, order, ascending.masked_fill(drop, float("-inf")))


def _logprobs(
    scores: torch.Tensor,
    chosen: torch.Tensor,
    params: list[SamplingParams],
    wants: list[bool],
) -> list[SampledLogprobs | None]:
    if not any(wants):
        return [None] * len(params)
    rows = [row for row, want in enumerate(wants) if want]
    if len(rows) == len(wants):  # every row: no copies
        logprobs, chosen_rows = scores.log_softmax(dim=-1), chosen
    else:
        index = torch.tensor(rows, device=scores.device)
        logprobs = scores.index_select(0, index).log_softmax(dim=-1)
        chosen_rows = chosen.index_select(0, index)
    chosen_lp = logprobs.gather(1, chosen_rows.unsqueeze(1)).squeeze(1).tolist()
    chosen_ids = chosen_rows.tolist()
    num_top = max(params[row].logprobs or 0 for row in rows)
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    top_v = top_values.tolist() if top_values is not None else [[]] * len(rows)
    top_i = top_ids.tolist() if top_ids is not None else [[]] * len(rows)
    out: list[SampledLogprobs | None] = [None] * len(params)
    for i, row in enumerate(rows):
        n = params[row].logprobs or 0
        out[row] = SampledLogprobs(
            token_id=chosen_ids[i],
            logprob=chosen_lp[i],
            top=tuple(zip(top_i[i][:n], top_v[i][:n], strict=True)),
        )
    return out
