"""KV cache formats simulated in transformers' attention, for their quality before any kernel.

Each mode rounds the keys and values an attention call reads (the cache's and the step's own) as
a cache in that format would hold them; the reference model then reads the text through
:func:`bench.lib.quality.score` as usual. Rounding twice is rounding once (a value already on a
mode's grid stays there: an int8 group keeps its largest value, so its scale), so the keys of
earlier steps are not moved again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

Pair = tuple[torch.Tensor, torch.Tensor]


def int8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` through symmetric int8 per token and head in groups of ``group`` along the head
    dimension, each group's scale (its largest magnitude / 127) stored as fp16."""
    shape = x.shape
    groups = x.reshape(*shape[:-1], shape[-1] // group, group)
    scale = (groups.abs().amax(-1, keepdim=True) / 127.0).half().float()
    rounded = torch.round(groups / scale.clamp_min(torch.finfo(torch.float32).tiny))
    return torch.where(scale > 0, rounded.clamp(-127, 127) * scale, groups).reshape(shape)


def _head(x: torch.Tensor) -> torch.Tensor:
    return int8_groups(x, x.shape[-1])


MODES: dict[str, Callable[[torch.Tensor, torch.Tensor], Pair]] = {
    "fp16": lambda k, v: (k.half().float(), v.half().float()),
    "bf16": lambda k, v: (k.bfloat16().float(), v.bfloat16().float()),
    "int8": lambda k, v: (_head(k), _head(v)),
    "int8-g32": lambda k, v: (int8_groups(k, 32), int8_groups(v, 32)),
    "int8-g16": lambda k, v: (int8_groups(k, 16), int8_groups(v, 16)),
    "int8-keys": lambda k, v: (_head(k), v.half().float()),
    "int8-values": lambda k, v: (k.half().float(), _head(v)),
}


@contextlib.contextmanager
def simulated_kv(mode: str) -> Iterator[None]:
    """While open, every ``sdpa`` attention call of a transformers model reads its keys and
    values as a ``mode`` cache holds them (:data:`MODES`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    rounding = MODES[mode]

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        key, value = rounding(key, value)
        return sdpa(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
