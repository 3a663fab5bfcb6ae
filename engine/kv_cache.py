"""KV cache bookkeeping (pure Python): which slot row a sequence owns and how many tokens it holds.

The tensors live in the model runner: one pre-allocated row of ``max_model_len`` positions per
slot, written in place. This class enforces the budget: the sum of reserved token positions over
all running sequences never exceeds ``num_tokens_total``, which may be smaller than
slots x max_model_len (a memory budget), so admission and decode growth are checked here.
"""

from __future__ import annotations

import heapq

from slotserve.engine.sequence import Sequence


class KVCacheManager:
    """Slots and token budget, with paired check/act methods (``can_*`` then the action)."""

    def __init__(self, *, num_slots: int, num_tokens_total: int) -> None:
        if num_slots < 1 or num_tokens_total < 1:
            raise ValueError("num_slots and num_tokens_total must be at least 1")
        self.num_slots = num_slots
        self.num_tokens_total = num_tokens_total
        self.num_tokens_used = 0
        # A heap, lowest free slot first: live rows stay packed at the front of the cache.
        self._free_slots: list[int] = list(range(num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_tokens_free(self) -> int:
        return self.num_tokens_total - self.num_tokens_used

    @property
    def usage(self) -> float:
        return self.num_tokens_used / self.num_tokens_total

    def can_allocate(self, seq: Sequence) -> bool:
        """A free slot and room for every token the sequence has now (prompt, or recompute)."""
        return bool(self._free_slots) and seq.num_tokens <= self.num_tokens_free

    def allocate(self, seq: Sequence) -> None:
        if not self.can_allocate(seq):
            raise RuntimeError(f"cannot allocate KV for {seq.request_id}")
        seq.slot = heapq.heappop(self._free_slots)
        seq.num_kv_tokens = seq.num_tokens
        self.num_tokens_used += seq.num_tokens

    def can_append(self, seq: Sequence) -> bool:
        """Room for the tokens appended since the last reservation (one per decode step)."""
        return seq.num_tokens - seq.num_kv_tokens <= self.num_tokens_free

    def append(self, seq: Sequence) -> None:
        growth = seq.num_tokens - seq.num_kv_tokens
        if growth > self.num_tokens_free:
            raise RuntimeError(f"cannot grow KV for {seq.request_id}")
        seq.num_kv_tokens += growth
        self.num_tokens_used += growth

    def free(self, seq: Sequence) -> None:
        if seq.slot is None:
            return
        self.num_tokens_used -= seq.num_kv_tokens
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = None
        seq.num_kv_tokens = 0
