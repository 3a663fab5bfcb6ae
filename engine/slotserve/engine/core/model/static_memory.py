"""GPU memory for the KV cache: read after the products are fused, less room for activations.

Fusing q/k/v and gate/up concatenates weights: while the new tensor exists next to its parts it
takes ~9 GB more for an 8B model, and the caching allocator keeps the parts' blocks after they
are freed. Fused first (and the cache emptied), the free memory read next is what stays free.
The KV rows then get ``kv_cache_memory_fraction`` of what remains after the activations of the
largest step: a prefill chunk of ``max_batched_tokens`` tokens (its products, its attention
scores over the row, its prompt logprobs) and the logits and sampling buffers of every slot.
"""

from __future__ import annotations

from typing import Any

import torch

from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.model.fusion import dense_linear, fuse_gated_mlps, fuse_qkv

# CUDA graph pools, cuBLAS workspaces and compiled kernels' scratch: not in any formula.
FIXED_HEADROOM_BYTES = 1 << 30
# [slots, vocab] float32 tensors alive at once while the device sampler runs (logits, scores,
# sorted values, int64 order, probabilities, cdf, logprobs, the scatter back).
SAMPLING_COPIES = 10


def fuse_before_sizing(model: Any) -> None:
    """Fuse ``model``'s q/k/v and gate/up products as the stock backend does (idempotent: the
    runner's own set-up then finds them fused) and hand the parts' memory back."""
    decoder = model.get_decoder()
    fuse_gated_mlps(decoder)
    fuse_qkv(decoder, dense_linear)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()


def headroom_bytes(
    config: Any,
    dtype: torch.dtype,
    *,
    max_batched_tokens: int,
    max_model_len: int,
    num_slots: int,
) -> int:
    """Activation memory of the largest step (see the module doc), an upper estimate."""
    element = torch.empty((), dtype=dtype).element_size()
    tokens = min(max_batched_tokens, max_model_len * num_slots)
    hidden = config.hidden_size
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // num_heads
    num_kv = getattr(config, "num_key_value_heads", None) or num_heads
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    per_token = 4 * hidden + (num_heads + 2 * num_kv) * head_dim + 4 * intermediate
    products = tokens * per_token * element
    # A chunk past position 0 attends with a mask: scores of every head over the row, float32.
    scores = num_heads * tokens * max_model_len * 4
    # Prompt logprobs score every token of the chunk: logits and their log-softmax, float32.
    prompt_logits = 2 * tokens * config.vocab_size * 4
    sampling = SAMPLING_COPIES * num_slots * config.vocab_size * 4
    return FIXED_HEADROOM_BYTES + products + scores + prompt_logits + sampling


def kv_budget_bytes(available: int, headroom: int, fraction: float) -> float:
    """``fraction`` of what is left for KV rows; refuses when activations alone do not fit."""
    if headroom >= available:
        raise UnsupportedSettingError(
            f"the GPU has {available / 2**30:.1f} GiB free after loading, and the largest step "
            f"needs ~{headroom / 2**30:.1f} GiB of activations before any KV row: lower "
            "max_batched_tokens, max_model_len or max_batch_size, or use a larger GPU"
        )
    return fraction * (available - headroom)
