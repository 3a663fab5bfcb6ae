"""Prompt logprobs from the prefill's own hidden states: no second forward pass.

A step's forward returns the last layer's hidden state of every token it computed; the runner
projects only the sampling rows to logits. For a sequence that asked for prompt logprobs, the
rows of its prompt positions are projected here too (in blocks, so a long chunk never holds a
``tokens x vocab`` matrix at once), and the logprob of prompt token ``i`` is read from the
log-softmax at position ``i - 1``: the model's raw distribution, in float32, as transformers
computes it (no temperature, penalties or masks: they belong to sampling, not to scoring).

The cost is the output projection of those rows (49152 x 576 per token for SmolLM2) plus a
log-softmax over the vocabulary; requests without prompt logprobs pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from slotserve.engine.core.logprobs import PromptLogprob
from slotserve.engine.core.scheduler import ScheduledChunk

# Rows projected to logits at once: 256 x 49152 float32 logits are 48 MiB.
BLOCK_ROWS = 256


def wanted_rows(chunk: ScheduledChunk) -> range:
    """Prompt tokens whose logprob this chunk's positions give and that are still missing."""
    seq = chunk.seq
    if seq.prompt_logprobs is None:
        return range(0)
    first = max(chunk.start + 1, seq.num_prompt_logprobs_done)
    last = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)  # inclusive
    return range(first, last + 1)


def record_prompt_logprobs(
    chunks: Seq[ScheduledChunk],
    hidden: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Fill ``seq.prompt_logprobs`` for the prompt tokens this step's chunks predict.

    ``hidden`` holds one row per computed token, the chunks' tokens packed in chunk order.
    """
    offset = 0
    for chunk in chunks:
        targets = wanted_rows(chunk)
        if targets:
            _record(chunk, hidden, offset, targets, logits_of)
        offset += chunk.num_tokens


def _record(
    chunk: ScheduledChunk,
    hidden: torch.Tensor,
    offset: int,
    targets: range,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    seq = chunk.seq
    assert seq.prompt_logprobs is not None and seq.params.prompt_logprobs is not None
    num_top = seq.params.prompt_logprobs
    for block_start in range(targets.start, targets.stop, BLOCK_ROWS):
        block = range(block_start, min(block_start + BLOCK_ROWS, targets.stop))
        # Token i is predicted by the row of position i - 1, at offset (i - 1 - chunk.start).
        first_row = offset + block.start - 1 - chunk.start
        rows = hidden[first_row : first_row + len(block)]
        logprobs = torch.log_softmax(logits_of(rows).float(), dim=-1)
        token_ids = torch.tensor(seq.token_ids[block.start : block.stop], device=rows.device)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        # Rank 1 is the most likely token; ties rank alike (vLLM counts strictly greater).
        ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
        if num_top:
            top_values, top_ids = logprobs.topk(num_top, dim=-1)
            top_rows = list(zip(top_ids.tolist(), top_values.tolist(), strict=True))
        else:
            top_rows = [([], [])] * len(block)
        for token_index, token_id, logprob, rank, (ids, values) in zip(
            block, token_ids.tolist(), chosen.tolist(), ranks.tolist(), top_rows, strict=True
        ):
            seq.prompt_logprobs[token_index] = PromptLogprob(
                token_id, logprob, rank, tuple(zip(ids, values, strict=True))
            )
        seq.num_prompt_logprobs_done = block.stop
