"""Logit processing before sampling: ``min_tokens``, ``logit_bias`` and the three penalties.

Applied to the whole step's ``[rows, vocab]`` logits with a few batched tensor ops; Python only
gathers each row's scalars (and the bias entries a request sent). vLLM's order: ``min_tokens``
and ``logit_bias`` first, then ``repetition_penalty`` (HF's rule, over prompt and output tokens:
a seen token's logit is divided by the penalty when positive, multiplied when negative), then
OpenAI's ``frequency_penalty`` x count and ``presence_penalty`` x (count > 0) over output tokens.

Which tokens a sequence has produced lives in a count row per slot (``[slots, vocab]`` int32,
allocated on the first request that needs it), updated incrementally: one batched scatter of each
row's newest token per step. A row is rebuilt from the sequence's tokens when its owner changed
(a new sequence in the slot, a preempted one back in another), so preemption and slot reuse by
the prefix cache need no hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from slotserve.engine.sequence import Sequence


class PenaltyState:
    """Per-slot output-token counts and prompt-token masks for the sequences that need them."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self._counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        # Which sequence each row describes, and how many of its output tokens are counted.
        self._owner: list[Sequence | None] = [None] * num_slots
        self._num_counted = [0] * num_slots

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None or self._prompt_mask is None:
            shape = (self.num_slots, self.vocab_size)
            self._counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self._counts, self._prompt_mask

    def sync(self, seqs: Seq[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the rows of ``seqs`` up to date; returns their (counts, prompt masks)."""
        counts, prompt_mask = self._tensors()
        add_slots: list[int] = []
        add_tokens: list[int] = []
        for seq in seqs:
            slot = seq.slot
            assert slot is not None  # the runner refuses slotless chunks before sampling
            num_generated = seq.num_generated_tokens
            if self._owner[slot] is seq and self._num_counted[slot] == num_generated:
                continue
            if self._owner[slot] is seq and self._num_counted[slot] == num_generated - 1:
                add_slots.append(slot)
                add_tokens.append(seq.token_ids[-1])
            else:
                self._rebuild(slot, seq)
            self._owner[slot] = seq
            self._num_counted[slot] = num_generated
        if add_slots:
            index = (self._index(add_slots), self._index(add_tokens))
            ones = torch.ones(len(add_slots), dtype=torch.int32, device=self.device)
            counts.index_put_(index, ones, accumulate=True)
        slots = self._index([seq.slot for seq in seqs])  # type: ignore[misc]
        return counts.index_select(0, slots), prompt_mask.index_select(0, slots)

    def _rebuild(self, slot: int, seq: Sequence) -> None:
        counts, prompt_mask = self._tensors()
        counts[slot].zero_()
        prompt_mask[slot].zero_()
        generated = seq.generated_token_ids
        if generated:
            ids = self._index(generated)
            counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        prompt_mask[slot, self._index(seq.prompt_token_ids)] = True

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
    scores = scores.clone()  # the caller's logits stay as the model produced them
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
    device = scores.device
    counts, prompt_mask = state.sync(seqs)
    row_index = torch.tensor(rows, device=device)
    sub = scores.index_select(0, row_index)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=sub.dtype, device=device).unsqueeze(1)

    repetition = [seq.params.repetition_penalty for seq in seqs]
    if any(value != 1.0 for value in repetition):
        penalty = column(repetition)
        seen = prompt_mask | (counts > 0)
        sub = torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub)
    frequency = [seq.params.frequency_penalty for seq in seqs]
    presence = [seq.params.presence_penalty for seq in seqs]
    if any(frequency) or any(presence):
        counts_f = counts.to(sub.dtype)
        sub = sub - column(frequency) * counts_f - column(presence) * (counts_f > 0).to(sub.dtype)
    scores.index_copy_(0, row_index, sub)
