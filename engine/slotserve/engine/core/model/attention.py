"""Attention over the per-slot KV cache, plugged into transformers through its AttentionInterface.

transformers' own continuous batching registers a paged attention function and hands the model
a flattened batch; we do the same with a simpler cache: one pre-allocated row of
``max_model_len`` positions per slot and layer, ``[num_slots, kv_heads, max_model_len, head_dim]``.
On a CPU, gathering pages into a contiguous tensor every step would copy the whole live context;
slot rows are read in place through views, so a step copies nothing but the new keys and values.

A step is packed into one sequence of ``T`` tokens (``[1, T]`` input ids and position ids). The
model computes rotary embeddings, projections and MLPs for all tokens at once; this function is
called once per layer with the step's new keys and values, writes them into the cache, and
computes attention: one batched call for all single-token chunks (decodes), one call per
multi-token prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from slotserve.engine.core.kernels import NativeKernels
from slotserve.engine.core.model.kv_dtype import to_cache

ATTN_IMPLEMENTATION = "slotserve_slots"


@dataclass(frozen=True)
class PrefillChunkInput:
    token_start: int  # index of the chunk's first token in the packed step
    num_tokens: int
    slot: int
    kv_len: int  # positions valid after this chunk is written (start position + num_tokens)
    mask: torch.Tensor | None  # [kv_heads-fold rows, kv_len] bool; None = plain causal from 0


@dataclass(frozen=True)
class SlotStep:
    """Everything every layer's attention needs for one step, built once per step."""

    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]
    write_slots: torch.Tensor  # [T] slot of each packed token
    write_positions: torch.Tensor  # [T] position of each packed token
    num_tokens: int
    # Decodes: queries scattered into rows [0, num_decode_rows) indexed by slot.
    decode_token_index: torch.Tensor | None  # [Bd] packed index of each decode token
    decode_slots: torch.Tensor | None  # [Bd]
    num_decode_rows: int
    decode_kv_len: int
    # [rows, 1, 1, decode_kv_len]: bool (True = attend) for SDPA, or an additive float mask
    # (0 / -inf) for the CPU path.
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillChunkInput, ...]
    # With the native kernels (CPU, fp32): decodes attend in one call over the cache rows in
    # place, from each row's length ([num_decode_rows] int64), and decode_mask is None.
    decode_lens: torch.Tensor | None = None
    native: NativeKernels | None = None


class AttentionModule(Protocol):
    """A transformers attention module, as the attention function sees it."""

    layer_idx: int


def slot_attention(
    module: AttentionModule,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    slot_step: SlotStep | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """Write this step's keys/values into the slot cache and attend; shapes as transformers'."""
    if slot_step is None:
        raise RuntimeError("slot_attention needs the `slot_step` keyword (use the ModelRunner)")
    layer = module.layer_idx
    k_cache, v_cache = slot_step.k_cache[layer], slot_step.v_cache[layer]
    # key/value: [1, kv_heads, T, head_dim] -> [T, kv_heads, head_dim] rows of the cache.
    k_cache[slot_step.write_slots, :, slot_step.write_positions] = to_cache(
        key[0].transpose(0, 1), k_cache
    )
    v_cache[slot_step.write_slots, :, slot_step.write_positions] = to_cache(
        value[0].transpose(0, 1), v_cache
    )

    num_heads, head_dim = query.shape[1], query.shape[3]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    q = query[0]  # [H, T, D]
    out = query.new_empty(slot_step.num_tokens, num_heads, head_dim)

    if slot_step.decode_token_index is not None:
        rows = slot_step.num_decode_rows
        kv_len = slot_step.decode_kv_len
        # Fold the query heads sharing a kv head into the query-length axis: no kv expansion.
        q_rows = q.new_zeros(rows, num_kv_heads, group, head_dim)
        q_dec = q[:, slot_step.decode_token_index, :].transpose(0, 1)  # [Bd, H, D]
        q_rows[slot_step.decode_slots] = q_dec.reshape(-1, num_kv_heads, group, head_dim)
        scale = scaling if scaling is not None else head_dim**-0.5
        if slot_step.native is not None and slot_step.decode_lens is not None:
            attn = slot_step.native.decode_attention(
                q_rows, k_cache, v_cache, slot_step.decode_lens, scale
            )
        else:
            attn = _decode_attention(
                q_rows,
                k_cache[:rows, :, :kv_len].to(q.dtype),
                v_cache[:rows, :, :kv_len].to(q.dtype),
                slot_step.decode_mask,
                scale,
            )
        out[slot_step.decode_token_index] = attn[slot_step.decode_slots].reshape(
            -1, num_heads, head_dim
        )

    for chunk in slot_step.prefills:
        n = chunk.num_tokens
        q_chunk = q[:, chunk.token_start : chunk.token_start + n, :]  # [H, n, D]
        q_fold = q_chunk.reshape(num_kv_heads, group * n, head_dim).unsqueeze(0)
        # An fp16 cache (kv_dtype.py) is widened here: a copy of the chunk's span per layer.
        k = k_cache[chunk.slot : chunk.slot + 1, :, : chunk.kv_len].to(q.dtype)
        v = v_cache[chunk.slot : chunk.slot + 1, :, : chunk.kv_len].to(q.dtype)
        if chunk.mask is None:
            # Whole prompt from position 0; folded rows are (head-in-group, token): plain causal
            # does not apply across the fold, so expand the heads instead (prefill is rare).
            attn = F.scaled_dot_product_attention(
                q_chunk.unsqueeze(0), k, v, is_causal=True, scale=scaling, enable_gqa=True
            )[0]
        else:
            attn = F.scaled_dot_product_attention(q_fold, k, v, attn_mask=chunk.mask, scale=scaling)
            attn = attn.reshape(num_heads, n, head_dim)
        out[chunk.token_start : chunk.token_start + n] = attn.transpose(0, 1)

    return out.unsqueeze(0), None


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query row per (slot, kv head, head in group) against that slot's cache row."""
    if mask is None or mask.dtype == torch.bool:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # CPU: SDPA's flash kernel handles a few query rows per head poorly (1.3 ms a layer at 32
    # sequences and 300 positions, against 0.75 ms for these three plain products).
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores.mul_(scale).add_(mask)
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v)


def register_slot_attention() -> str:
    """Register :func:`slot_attention` (idempotent); returns the implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention)
    return ATTN_IMPLEMENTATION
