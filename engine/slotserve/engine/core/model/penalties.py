"""Logit processing before sampling: ``min_tokens``, ``logit_bias`` and the three penalties.

Applied to the whole step's ``[rows, vocab]`` logits with a few batched tensor ops; Python only
gathers each row's scalars (and the bias entries a request sent). vLLM's order: ``min_tokens``
and ``logit_bias`` first, then ``repetition_penalty`` (HF's rule, over prompt and output tokens:
a seen token's logit is divided by the penalty when positive, multiplied when negative), then
OpenAI's ``frequency_penalty`` x count and ``presence_penalty`` x (count > 0) over output tokens.

The penalties touch only the tokens a sequence has seen: its tokens are mirrored per slot in a
padded ``[slots, length]`` tensor, updated incrementally (one batched write of each row's newest
token per step) and copied again when a row's owner changed (a new sequence in the slot, a
preempted one back in another), so preemption and slot reuse by the prefix cache need no hooks.
Each step gathers the penalized rows' tokens and adds into the flat logits at ``row x vocab +
token``: the cost grows with the tokens seen, not with the vocabulary (49,152 for SmolLM2).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from slotserve.engine.core.sequence import Sequence


class PenaltyState:
    """A mirror of each penalized sequence's tokens (prompt then output) per slot, padded."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self._tokens = torch.zeros((num_slots, 0), dtype=torch.long, device=device)
        # Which sequence each row mirrors, and how many of its tokens are copied.
        self._owner: list[Sequence | None] = [None] * num_slots
        self._num_copied = [0] * num_slots

    def sync(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Bring the rows of ``seqs`` up to date; returns their tokens ``[len(seqs), longest]``
        (positions past a sequence's length hold stale values: mask them by length)."""
        longest = max(seq.num_tokens for seq in seqs)
        if longest > self._tokens.shape[1]:  # grows by doubling: a handful of copies per run
            wider = torch.zeros(
                (self.num_slots, max(256, 2 * longest)), dtype=torch.long, device=self.device
            )
            wider[:, : self._tokens.shape[1]] = self._tokens
            self._tokens = wider
        add_slots: list[int] = []
        add_positions: list[int] = []
        add_tokens: list[int] = []
        for seq in seqs:
            slot = seq.slot
            assert slot is not None  # the runner refuses slotless chunks before sampling
            num_tokens = seq.num_tokens
            copied = self._num_copied[slot] if self._owner[slot] is seq else -1
            if copied == num_tokens - 1:  # the steady state: one new token
                add_slots.append(slot)
                add_positions.append(num_tokens - 1)
                add_tokens.append(seq.token_ids[-1])
            elif copied != num_tokens:  # a new owner, or back from preemption
                self._tokens[slot, :num_tokens] = self._index(seq.token_ids)
            self._owner[slot] = seq
            self._num_copied[slot] = num_tokens
        if add_slots:
            index = (self._index(add_slots), self._index(add_positions))
            self._tokens.index_put_(index, self._index(add_tokens))
        slots = self._index([seq.slot for seq in seqs])  # type: ignore[misc]
        return self._tokens.index_select(0, slots)[:, :longest]

    def _index(self, values: Iterable[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.device)


def process_logits(
    scores: torch.Tensor,
    seqs: Seq[Sequence],
    state: PenaltyState,
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    """``scores`` (float, ``[rows, vocab]``) after min_tokens, logit_bias and the penalties.

    Returns ``scores`` itself when no row asks for any of them (the common case costs a scan of
    the parameters, no tensor op).
    """
    vocab_size = scores.shape[-1]
    device = scores.device
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    penalized: list[int] = []
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.min_tokens and seq.num_generated_tokens < params.min_tokens:
            # vLLM's rule: neither EOS (unless ignored) nor a stop token before min_tokens.
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned |= eos_token_ids
            ids = [token_id for token_id in banned if token_id < vocab_size]
            ban_rows.extend([row] * len(ids))
            ban_ids.extend(ids)
        if params.logit_bias:
            for token_id, value in params.logit_bias.items():
                if token_id < vocab_size:  # the API checks the vocabulary; never index past it
                    bias_rows.append(row)
                    bias_ids.append(token_id)
                    bias_values.append(value)
        if params.has_penalties:
            penalized.append(row)
    if not (ban_rows or bias_rows or penalized):
        return scores
    # A contiguous copy: the caller keeps its logits, and the penalties index the flat view.
    scores = scores.clone(memory_format=torch.contiguous_format)
    if bias_rows:
        index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device))
        values = torch.tensor(bias_values, dtype=scores.dtype, device=device)
        scores.index_put_(index, values, accumulate=True)
    if ban_rows:
        index = (torch.tensor(ban_rows, device=device), torch.tensor(ban_ids, device=device))
        scores.index_put_(index, torch.tensor(float("-inf"), device=device))
    if penalized:
        _apply_penalties(scores, [seqs[row] for row in penalized], penalized, state)
    return scores


def _apply_penalties(
    scores: torch.Tensor, seqs: list[Sequence], rows: list[int], state: PenaltyState
) -> None:
    """Touch only the tokens each row has seen (``[rows, length]`` gathers and scatters into
    the flat ``scores``), never whole ``[rows, vocab]`` tensors: O(tokens), not O(vocabulary)."""
    device = scores.device
    vocab_size = scores.shape[1]
    tokens = state.sync(seqs)
    positions = torch.arange(tokens.shape[1], device=device)
    lengths = torch.tensor([seq.num_tokens for seq in seqs], device=device)
    prompt_lengths = torch.tensor([seq.num_prompt_tokens for seq in seqs], device=device)
    valid = positions < lengths.unsqueeze(1)
    output = valid & (positions >= prompt_lengths.unsqueeze(1))
    flat = torch.tensor(rows, device=device).unsqueeze(1) * vocab_size + tokens
    flat_scores = scores.view(-1)

    def per_token(values: list[float]) -> torch.Tensor:
        column = torch.tensor(values, dtype=scores.dtype, device=device).unsqueeze(1)
        return column.expand(tokens.shape)

    repetition = [seq.params.repetition_penalty for seq in seqs]
    if any(value != 1.0 for value in repetition):
        # HF's rule over prompt and output: each distinct seen token once.
        first = _first(flat, valid)
        index, penalty = flat[first], per_token(repetition)[first]
        seen = flat_scores[index]
        flat_scores[index] = torch.where(seen < 0, seen * penalty, seen / penalty)
    frequency = [seq.params.frequency_penalty for seq in seqs]
    if any(frequency):  # once per occurrence in the output: index_add accumulates repeats
        flat_scores.index_add_(0, flat[output], -per_token(frequency)[output])
    presence = [seq.params.presence_penalty for seq in seqs]
    if any(presence):  # once per distinct output token
        first = _first(flat, output)
        flat_scores.index_add_(0, flat[first], -per_token(presence)[first])


def _first(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Of the masked positions, those holding the first occurrence of their value in the row."""
    masked = torch.where(mask, flat, torch.full_like(flat, -1))
    ordered, order = masked.sort(dim=1, stable=True)
    first_sorted = torch.ones_like(mask)
    first_sorted[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    first = torch.zeros_like(mask).scatter_(1, order, first_sorted)
    return first & mask
