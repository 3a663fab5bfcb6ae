"""One step's chunks as the forward takes them, built by kind as nano-vllm's runner does: the
rows every kind shares (token, position, slot; which rows sample), then the decode rows' lengths
and mask, then each prefill chunk's mask."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from slotserve.engine.core.model.attention import PrefillChunkInput
from slotserve.engine.core.scheduler import ScheduledChunk


@dataclass(frozen=True)
class PrefillRows:
    token_start: int  # the chunk's first row in the step
    num_tokens: int
    slot: int
    start: int  # the chunk's first position in its slot


@dataclass
class StepRows:
    """Every row of a step, one per scheduled token, in chunk order."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    # The last row of each chunk that samples: the rows the logits are computed for.
    sample_index: list[int] = field(default_factory=list)
    # Decode chunks (one token): their row, slot and length once this step has written it.
    decode_token_index: list[int] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    prefills: list[PrefillRows] = field(default_factory=list)


def step_rows(chunks: Seq[ScheduledChunk]) -> StepRows:
    """The rows of ``chunks``: a prefill chunk is one row per token of its sequence's slot."""
    rows = StepRows()
    for chunk in chunks:
        seq = chunk.seq
        if seq.slot is None:
            raise RuntimeError(f"sequence {seq.request_id} is scheduled without a slot")
        token_start = len(rows.token_ids)
        end = chunk.start + chunk.num_tokens
        rows.token_ids.extend(seq.token_ids[chunk.start : end])
        rows.positions.extend(range(chunk.start, end))
        rows.slots.extend([seq.slot] * chunk.num_tokens)
        if chunk.num_tokens == 1:
            rows.decode_token_index.append(token_start)
            rows.decode_slots.append(seq.slot)
            rows.decode_lens.append(end)
        else:
            rows.prefills.append(PrefillRows(token_start, chunk.num_tokens, seq.slot, chunk.start))
        if chunk.samples:
            rows.sample_index.append(len(rows.token_ids) - 1)
    return rows


@dataclass(frozen=True)
class DecodeInputs:
    num_rows: int  # slot rows the batched decode attention covers (0: no decode rows)
    kv_len: int  # the longest decode row's length
    # The native attention's per-row lengths (idle rows 0), else the torch attention's mask.
    native_lens: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def decode_inputs(
    rows: StepRows,
    *,
    native: bool,
    arange: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> DecodeInputs:
    """What the batched decode attention reads: per slot row, how many positions it attends to
    (``native``: the kernels' lengths; else a mask, additive on a CPU)."""
    if not rows.decode_slots:
        return DecodeInputs(0, 0)
    num_rows = max(rows.decode_slots) + 1
    kv_len = max(rows.decode_lens)
    if native:
        row_lens = [0] * num_rows  # idle rows: no positions, zeros out, never read back
        for slot, length in zip(rows.decode_slots, rows.decode_lens, strict=True):
            row_lens[slot] = length
        return DecodeInputs(num_rows, kv_len, native_lens=torch.tensor(row_lens, dtype=torch.long))
    lens = torch.zeros(num_rows, dtype=torch.long, device=device)
    # Rows of idle slots attend to position 0 only: finite garbage, never read back.
    lens.fill_(1)
    lens[torch.tensor(rows.decode_slots, device=device)] = torch.tensor(
        rows.decode_lens, device=device
    )
    mask = (arange[:kv_len].unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
    if device.type == "cpu":
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
            ~mask, float("-inf")
        )
    return DecodeInputs(num_rows, kv_len, mask=mask)


def prefill_inputs(
    rows: StepRows, *, arange: torch.Tensor, group: int
) -> tuple[PrefillChunkInput, ...]:
    """Each prefill chunk's attention input: a causal mask over its slot's positions when the
    chunk starts past position 0 (earlier chunks or a reused prefix), else none (plain causal).
    ``group``: query heads per kv head."""
    prefills = []
    for chunk in rows.prefills:
        mask = None
        if chunk.start > 0:
            query_pos = arange[chunk.start : chunk.start + chunk.num_tokens].unsqueeze(1)
            causal = arange[: chunk.start + chunk.num_tokens].unsqueeze(0) <= query_pos
            mask = causal.repeat(group, 1)  # rows follow the (head-in-group, token) fold
        kv_len = chunk.start + chunk.num_tokens
        prefills.append(
            PrefillChunkInput(chunk.token_start, chunk.num_tokens, chunk.slot, kv_len, mask)
        )
    return tuple(prefills)
