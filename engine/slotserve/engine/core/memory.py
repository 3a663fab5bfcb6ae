"""How much memory the KV cache may take, and how many slot rows that buys (pure; no torch).

The budget is what the process can still use (``slotserve.host_memory``: ``MemAvailable``
capped by every cgroup's headroom, as the kubelet sees it).

The cache is one row of ``max_model_len`` positions per slot, and a row's pages stay committed
once written (on a GPU, all of it at once), so the rows themselves must fit the budget: a budget
smaller than ``max_batch_size x max_model_len`` buys fewer slots, not a smaller token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.host_memory import SYSTEM, MemorySources, available_memory_bytes

__all__ = ["SYSTEM", "KVCacheSize", "MemorySources", "available_memory_bytes", "size_kv_cache"]


@dataclass(frozen=True)
class KVCacheSize:
    num_slots: int  # slot rows allocated, max_model_len positions each
    num_tokens: int  # the scheduler's token budget over all slots


def size_kv_cache(
    *,
    max_batch_size: int,
    max_model_len: int,
    bytes_per_token: int,
    budget_bytes: float,
    kv_cache_tokens: int | None = None,
) -> KVCacheSize:
    """Slots and token budget for a memory budget (or an explicit token budget).

    An explicit ``kv_cache_tokens`` keeps every slot and makes the scheduler preempt to stay
    under it (it does not shrink the rows). Otherwise the rows must fit ``budget_bytes``.
    """
    slot_capacity = max_batch_size * max_model_len
    if kv_cache_tokens is not None:
        return KVCacheSize(max_batch_size, min(kv_cache_tokens, slot_capacity))
    budget_tokens = int(budget_bytes // bytes_per_token)
    num_slots = min(max_batch_size, budget_tokens // max_model_len)
    if num_slots < 1:
        raise ValueError(
            f"the KV cache budget ({budget_bytes / 2**20:.0f} MiB, {budget_tokens} tokens) cannot "
            f"hold one sequence of max_model_len {max_model_len}: lower max_model_len, raise "
            "kv_cache_memory_fraction or the memory limit, or set kv_cache_tokens"
        )
    return KVCacheSize(num_slots, num_slots * max_model_len)


def spare_rows_problem(
    *,
    num_rows: int,
    max_model_len: int,
    bytes_per_token: int,
    budget_bytes: float,
) -> str | None:
    """Why ``num_rows`` KV rows (``prefix_cache_rows`` beyond the slots) do not fit
    ``budget_bytes``, in one line; None when they fit.

    Spare rows are cache only, so unlike slots they are never cut to what fits: a setting that
    asks for more than the memory holds is refused rather than quietly given fewer.
    """
    row_bytes = max_model_len * bytes_per_token
    if num_rows * row_bytes <= budget_bytes:
        return None
    fits = int(budget_bytes // row_bytes)
    return (
        f"prefix_cache_rows {num_rows} needs {num_rows * row_bytes / 2**20:.0f} MiB of KV "
        f"({row_bytes / 2**20:.1f} MiB per row of {max_model_len} positions) but the KV budget "
        f"is {budget_bytes / 2**20:.0f} MiB ({fits} rows): lower prefix_cache_rows or "
        "max_model_len, or raise kv_cache_memory_fraction or the memory limit"
    )
