"""The static decode step: one function that a CUDA graph can capture, the same on CPU.

gpt-fast's recipe: a cache allocated once and written in place, fixed shapes per batch-size
bucket, and the whole step (embedding, layers, logits, sampling) as one function for
``torch.compile``. Decode-only steps whose rows the device sampler serves run here; the runner
keeps the transformers forward for prefill and for the rest.

The step calls the model's own modules (embedding, norms, the fused q/k/v and gate/up products,
rotary embedding, output layer) and writes attention itself: keys and values go to
``cache[slot, :, position]`` by index, and each row attends to its slot's first ``kv_len``
positions (a bucket, see :func:`static_buffers.kv_buckets`) through a gather of those rows and two
batched products. The length mask is built once per step from the position column (a ``[rows,
kv_len]`` additive tensor that every layer broadcasts) and never per layer. Why not FlexAttention
or FlashAttention's ``cache_batch_idx``: the products and the gather are stock operations that
``fullgraph`` compiles on every device torch runs on, so the CPU proof covers the code the GPU
runs; the gather costs one extra pass over the live keys and values, which at short contexts is
small next to the weights (the bench's table shows it).

No value goes back to Python inside the step: the inputs arrive in one copy and the result
leaves in one (:class:`static_buffers.Transfers`). The step keeps its sampled tokens on the
device (``last_tokens``) too: with overlapped steps (:mod:`slotserve.engine.core.overlap`) the
next step is launched before the host has read them, and its rows name the previous step's row
whose token is their input (``PREVIOUS_ROW``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slotserve.engine.core.model.device_sampling import full_result, greedy_result
from slotserve.engine.core.model.fusion import FusedGatedMLP, QKVPart
from slotserve.engine.core.model.static_buffers import POSITION, PREVIOUS_ROW, SLOT, TOKEN

# Decoder layers whose forward is exactly norm -> q/k/v -> rotary -> attention -> o_proj ->
# residual -> norm -> MLP -> residual (no q/k norms, no scaled embeddings).
STATIC_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


@dataclass(frozen=True)
class StaticLayer:
    input_norm: nn.Module
    qkv: tuple[nn.Module, ...]  # one fused product, or q, k and v
    qkv_sizes: tuple[int, ...]
    o_proj: nn.Module
    post_norm: nn.Module
    mlp: nn.Module


@dataclass(frozen=True)
class StaticModel:
    """The modules of a Llama-family model that a decode step calls, and its attention shape."""

    embed: nn.Module
    rotary: nn.Module
    layers: tuple[StaticLayer, ...]
    norm: nn.Module
    lm_head: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


def static_model_problem(model: Any) -> str | None:
    """Why ``model`` cannot run the static step, or None when it can."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in STATIC_MODEL_TYPES:
        return f"model type {model_type!r} (the static step serves {sorted(STATIC_MODEL_TYPES)})"
    decoder = model.get_decoder()
    for layer in decoder.layers:
        attention = layer.self_attn
        if hasattr(attention, "q_norm") or not hasattr(attention, "scaling"):
            return f"{type(attention).__name__} has q/k norms or no scaling"
        for name in ("q_proj", "k_proj", "v_proj"):
            if type(getattr(attention, name)) not in (nn.Linear, QKVPart):
                return f"{name} is {type(getattr(attention, name)).__name__} (quantized or native)"
        if type(layer.mlp) is not FusedGatedMLP and not hasattr(layer.mlp, "gate_proj"):
            return f"{type(layer.mlp).__name__} is not a gated MLP"
    return None


def static_model(model: Any) -> StaticModel:
    """The step's view of ``model`` (after the runner fused its products)."""
    problem = static_model_problem(model)
    if problem is not None:
        raise ValueError(f"the static decode step cannot run this model: {problem}")
    decoder = model.get_decoder()
    layers = []
    for layer in decoder.layers:
        attention = layer.self_attn
        q_proj = attention.q_proj
        if isinstance(q_proj, QKVPart):
            qkv: tuple[nn.Module, ...] = (q_proj.shared.linear,)
            sizes = tuple(q_proj.shared.sizes)
        else:
            linears: tuple[nn.Linear, ...] = (q_proj, attention.k_proj, attention.v_proj)
            qkv, sizes = linears, tuple(linear.out_features for linear in linears)
        layers.append(
            StaticLayer(
                layer.input_layernorm,
                qkv,
                sizes,
                attention.o_proj,
                layer.post_attention_layernorm,
                layer.mlp,
            )
        )
    config = model.config
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return StaticModel(
        embed=decoder.embed_tokens,
        rotary=decoder.rotary_emb,
        layers=tuple(layers),
        norm=decoder.norm,
        lm_head=model.get_output_embeddings(),
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        scale=float(decoder.layers[0].self_attn.scaling),
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def input_tokens(ints: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
    """Each row's input token: from the host block, or the previous step's sampled token."""
    previous = ints[PREVIOUS_ROW]
    chained = last_tokens.index_select(0, previous.clamp(min=0))
    return torch.where(previous >= 0, chained, ints[TOKEN])


def decode_step(
    model: StaticModel,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    ints: torch.Tensor,
    floats: torch.Tensor,
    eos_mask: torch.Tensor,
    prompt_seen: torch.Tensor,
    output_counts: torch.Tensor,
    kv_positions: torch.Tensor,
    last_tokens: torch.Tensor,
    full: bool,
    num_top: int,
) -> torch.Tensor:
    """One decode token per row of the input block: writes each row's key and value at its slot
    and position, attends to the slot's positions up to its own, samples; returns the result
    block of :mod:`slotserve.engine.core.model.device_sampling`. ``kv_positions``:
    ``arange(kv_len)``;
    ``last_tokens``: the sampled tokens, read by the next step's chained rows and then written."""
    tokens, positions, slots = input_tokens(ints, last_tokens), ints[POSITION], ints[SLOT]
    num_rows = tokens.shape[0]
    num_kv, head_dim = model.num_kv_heads, model.head_dim
    group = model.num_heads // num_kv
    kv_len = kv_positions.shape[0]
    x = model.embed(tokens)
    cos, sin = model.rotary(x, positions.unsqueeze(0))
    cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [rows, 1, head_dim]
    # Once per step: 0 where a row may attend, -inf past its position.
    allowed = kv_positions.unsqueeze(0) <= positions.unsqueeze(1)
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=x.device)
    mask = mask.masked_fill(~allowed, float("-inf"))[:, None, None, :]
    for index, layer in enumerate(model.layers):
        h = layer.input_norm(x)
        if len(layer.qkv) == 1:
            q, k, v = layer.qkv[0](h).split(layer.qkv_sizes, dim=-1)
        else:
            q, k, v = (linear(h) for linear in layer.qkv)
        q = _rotate(q.reshape(num_rows, model.num_heads, head_dim), cos, sin)
        k = _rotate(k.reshape(num_rows, num_kv, head_dim), cos, sin)
        k_rows, v_rows = k_cache[index], v_cache[index]
        k_rows[slots, :, positions] = k
        v_rows[slots, :, positions] = v.reshape(num_rows, num_kv, head_dim)
        keys = k_rows[:, :, :kv_len].index_select(0, slots)  # [rows, kv heads, kv_len, dim]
        values = v_rows[:, :, :kv_len].index_select(0, slots)
        q_group = q.reshape(num_rows, num_kv, group, head_dim)
        scores = torch.matmul(q_group, keys.transpose(-1, -2)).float() * model.scale + mask
        probs = scores.softmax(dim=-1).to(values.dtype)
        attn = torch.matmul(probs, values).reshape(num_rows, model.num_heads * head_dim)
        x = x + layer.o_proj(attn)
        x = x + layer.mlp(layer.post_norm(x))
    logits = model.lm_head(model.norm(x))
    if full:
        result = full_result(
            logits, tokens, ints, floats, eos_mask, prompt_seen, output_counts, num_top
        )
    else:
        result = greedy_result(logits)
    last_tokens[:num_rows].copy_(result[:, 0].to(torch.int64))
    return result
