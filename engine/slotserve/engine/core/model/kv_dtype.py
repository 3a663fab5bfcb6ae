"""Which dtype the KV cache stores: fp16 where the native CPU kernels read it (issue 24).

At 32 decode rows a step's attention streams every row's keys and values from memory (SmolLM2
at ~1,000 positions: 1.6 GB a step in fp32, ~42 ms of a ~60 ms step on a 2-core Zen 5). fp16
halves the bytes (21 ms there) and the memory a token holds; the kernels widen it to fp32 as
they read (``kernels/kv_half.c``) and every sum stays fp32, so only the stored keys and values
are rounded (11 significant bits, as llama.cpp's default f16 cache; vLLM's CPU cache is bf16, 8
bits). Its quality is measured against the fp32 cache in ``bench/quant_quality.py``.

Only the native kernels read fp16 in place: the static step (CUDA graphs, or its eager CPU
form) and the torch-only paths keep the weights' dtype, and an explicit ``float16`` there is
refused (exit 2) rather than run through copies.
"""

from __future__ import annotations

import torch

from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.kernels import NativeKernels
from slotserve.engine.settings import KVCacheDType

# fp16's largest finite value: keys and values beyond it are stored as +-HALF_MAX (kv_half.c),
# not inf, which would turn every score of their row into NaN.
HALF_MAX = 65504.0


def dtype_name(dtype: torch.dtype) -> str:
    """``float16`` for ``torch.float16``: how settings, logs and ``/load`` spell a dtype."""
    return str(dtype).removeprefix("torch.")


def pick_kv_dtype(
    wanted: KVCacheDType,
    *,
    model_dtype: torch.dtype,
    kernels: NativeKernels | None,
    static: bool,
) -> torch.dtype:
    """The cache's dtype for ``wanted`` on this load (see the module docstring); raises
    :class:`UnsupportedSettingError` for a dtype asked for by name that this load cannot run."""
    native = kernels is not None and not static and model_dtype == torch.float32
    if wanted == "auto":
        return torch.float16 if native else model_dtype
    chosen = torch.float16 if wanted == "float16" else torch.float32
    if chosen == model_dtype:
        return chosen
    if chosen == torch.float16 and native:
        return chosen
    why = (
        "the native CPU kernels (fp32 weights, the classic decode step, a C compiler)"
        if chosen == torch.float16
        else f"weights of that dtype (these are {dtype_name(model_dtype)})"
    )
    raise UnsupportedSettingError(f"kv_cache_dtype {wanted} needs {why}")


def to_cache(rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """``rows`` in the cache's dtype, rounded and saturated as the kernels store them."""
    if rows.dtype == cache.dtype:
        return rows
    if cache.dtype == torch.float16:
        rows = rows.clamp(-HALF_MAX, HALF_MAX)  # NaN stays NaN
    return rows.to(cache.dtype)
