"""Repetition, frequency and presence penalties inside the static step: per-slot count rows.

The eager sampler gathers each penalized sequence's tokens every step (a padded mirror whose
length grows); a captured graph needs fixed shapes, so here every slot (and the scratch row)
owns two dense rows on the device: which tokens its prompt holds, and how many times each token
was generated. The step itself adds its input token (the token sampled last step) to its slot's
counts when it is an output token, so the steady state moves nothing. A row is rebuilt from
the sequence's tokens (one copy, counted by :class:`static_buffers.Transfers` as a set-up) when
its slot has a new owner, or when steps that did not run here (a prefill beside it, a
preemption) left its counts behind.

The rules are the eager ones (:mod:`slotserve.engine.core.model.penalties`): HF's repetition penalty
over prompt and output (a seen token's logit divided by the penalty when positive, multiplied
when negative), then ``frequency x count`` and ``presence x (count > 0)`` over the output.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from slotserve.engine.core.model.static_buffers import (
    FREQUENCY,
    POSITION,
    PRESENCE,
    PROMPT_LEN,
    REPETITION,
    SLOT,
    Transfers,
)

if TYPE_CHECKING:
    from slotserve.engine.core.sequence import Sequence


class PenaltyRows:
    """Per-slot prompt-token marks and output-token counts, kept on the device."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.prompt_seen = torch.zeros((num_rows, vocab_size), dtype=torch.bool, device=device)
        self.output_counts = torch.zeros((num_rows, vocab_size), dtype=torch.int32, device=device)
        self.vocab_size = vocab_size
        self._owner: list[Sequence | None] = [None] * num_rows
        # Positions whose tokens are in the row's counts (the next input token's position).
        self._counted: list[int] = [0] * num_rows

    def prepare(self, seqs: Seq[Sequence], positions: Seq[int], transfers: Transfers) -> None:
        """Rebuild the rows of penalized ``seqs`` whose counts do not reach ``positions``; the
        step then counts each row's input token itself."""
        for seq, position in zip(seqs, positions, strict=True):
            slot = seq.slot
            assert slot is not None  # the runner refuses slotless chunks first
            if not seq.params.has_penalties:
                # The step counts this row's tokens too: the row is no one's count any more.
                self._owner[slot] = None
                continue
            if self._owner[slot] is not seq or self._counted[slot] != position:
                self._rebuild(slot, seq, position, transfers)
            self._owner[slot] = seq
            self._counted[slot] = position + 1  # the step adds the token at ``position``

    def _rebuild(self, slot: int, seq: Sequence, position: int, transfers: Transfers) -> None:
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        output = seq.token_ids[seq.num_prompt_tokens : position]  # before the step's input
        seen = torch.zeros(self.vocab_size, dtype=torch.bool)
        seen[torch.tensor(prompt, dtype=torch.long)] = True
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=self.vocab_size)
        transfers.set_up(seen, self.prompt_seen[slot])
        transfers.set_up(counts.to(torch.int32), self.output_counts[slot])

    def forget(self, slot: int) -> None:
        """The slot's row is stale (its sequence failed or a classic step ran it)."""
        self._owner[slot] = None


def count_and_apply(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    prompt_seen: torch.Tensor,
    output_counts: torch.Tensor,
) -> torch.Tensor:
    """In the step: count each row's input token ``tokens`` (an output token past the prompt), then
    penalize ``scores`` ``[rows, vocab]`` float32. Rows without penalties (1, 0, 0) are
    unchanged; their counts are never read."""
    slots = ints[SLOT]
    is_output = (ints[POSITION] >= ints[PROMPT_LEN]).to(output_counts.dtype)
    output_counts.index_put_((slots, tokens), is_output, accumulate=True)
    counts = output_counts.index_select(0, slots).to(scores.dtype)
    generated = counts > 0
    seen = prompt_seen.index_select(0, slots) | generated
    repetition = floats[REPETITION].to(scores.dtype).unsqueeze(1)
    penalized = torch.where(scores < 0, scores * repetition, scores / repetition)
    scores = torch.where(seen, penalized, scores)
    frequency = floats[FREQUENCY].to(scores.dtype).unsqueeze(1)
    presence = floats[PRESENCE].to(scores.dtype).unsqueeze(1)
    return scores - frequency * counts - presence * generated.to(scores.dtype)
