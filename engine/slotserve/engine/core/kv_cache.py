"""KV cache bookkeeping (pure Python): which slot row a sequence owns and how many tokens it holds.

The tensors live in the model runner: one pre-allocated row of ``max_model_len`` positions per
slot, written in place, and with ``prefix_cache_rows`` spare rows beyond the slots that only
keep finished prefixes (at most ``num_slots`` sequences hold a row at once). This class enforces
the budget: the sum of reserved token positions over all running sequences never exceeds
``num_tokens_total``, which may be smaller than slots x max_model_len (a memory budget), so
admission and decode growth are checked here.

With prefix caching (:mod:`slotserve.engine.core.prefix_cache`), a new sequence may start with some
tokens already computed: the slot is chosen for the prefix its row holds, and ``allocate``
returns the row copies the runner must make before the step's forward.
"""

from __future__ import annotations

import heapq

from slotserve.engine.core.prefix_cache import SlotCopy, SlotPrefixCache
from slotserve.engine.core.sequence import Sequence


class KVCacheManager:
    """Slots and token budget, with paired check/act methods (``can_*`` then the action)."""

    def __init__(
        self,
        *,
        num_slots: int,
        num_tokens_total: int,
        enable_prefix_caching: bool = False,
        num_rows: int | None = None,
    ) -> None:
        """``num_slots`` sequences at most hold a row at once, among ``num_rows`` rows (default
        one per slot); rows beyond the slots keep finished prefixes (``prefix_cache_rows``)."""
        num_rows = num_slots if num_rows is None else num_rows
        if num_slots < 1 or num_tokens_total < 1:
            raise ValueError("num_slots and num_tokens_total must be at least 1")
        if num_rows < num_slots:
            raise ValueError("num_rows must be at least num_slots")
        self.num_slots = num_slots
        self.num_rows = num_rows
        self.num_tokens_total = num_tokens_total
        self.num_tokens_used = 0
        # A heap of rows no sequence holds, lowest first: live rows stay packed at the front.
        # A sequence's row id is what the runner calls its slot.
        self._free_slots: list[int] = list(range(num_rows))
        self.prefix_cache = (
            SlotPrefixCache(num_rows, spare_rows=num_rows > num_slots)
            if enable_prefix_caching
            else None
        )
        # vLLM's prefix-cache counters, in tokens, over first admissions (not recomputes).
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_free_slots(self) -> int:
        """Slots free for a new sequence (not rows: spare rows run nobody)."""
        return self.num_slots - (self.num_rows - len(self._free_slots))

    @property
    def num_tokens_free(self) -> int:
        return self.num_tokens_total - self.num_tokens_used

    @property
    def usage(self) -> float:
        return self.num_tokens_used / self.num_tokens_total

    def can_allocate(self, seq: Sequence) -> bool:
        """A free slot and room for every token the sequence has now (prompt, or recompute)."""
        return self.num_free_slots > 0 and seq.num_tokens <= self.num_tokens_free

    def should_wait_for_prefix(self, seq: Sequence) -> bool:
        """With prefix caching: a running sequence is computing a prefix ``seq`` shares (see
        :meth:`SlotPrefixCache.should_wait`), so admitting ``seq`` later saves its recompute."""
        return self.prefix_cache is not None and self.prefix_cache.should_wait(seq)

    def allocate(self, seq: Sequence) -> tuple[SlotCopy, ...]:
        """Give ``seq`` a slot and reserve its tokens; with prefix caching, mark the tokens its
        row already holds as computed. Returns the row copies to make before the next forward.
        """
        if not self.can_allocate(seq):
            raise RuntimeError(f"cannot allocate KV for {seq.request_id}")
        copies: tuple[SlotCopy, ...] = ()
        if self.prefix_cache is None:
            seq.slot = heapq.heappop(self._free_slots)
        else:
            choice = self.prefix_cache.choose(seq, self._free_slots)
            self._free_slots.remove(choice.slot)
            heapq.heapify(self._free_slots)
            seq.slot = choice.slot
            seq.num_computed_tokens = choice.num_cached_tokens
            copies = choice.copies
            self.prefix_cache.occupy(choice.slot, seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = choice.num_cached_tokens
                self.num_prefix_query_tokens += seq.num_tokens
                self.num_prefix_hit_tokens += choice.num_cached_tokens
        seq.num_kv_tokens = seq.num_tokens
        self.num_tokens_used += seq.num_tokens
        return copies

    def can_append(self, seq: Sequence, num_pending: int = 0) -> bool:
        """Room for the tokens appended since the last reservation (one per decode step), and
        ``num_pending`` sampled on the device but not appended yet (overlapped steps)."""
        return seq.num_tokens + num_pending - seq.num_kv_tokens <= self.num_tokens_free

    def append(self, seq: Sequence, num_pending: int = 0) -> None:
        growth = seq.num_tokens + num_pending - seq.num_kv_tokens
        if growth > self.num_tokens_free:
            raise RuntimeError(f"cannot grow KV for {seq.request_id}")
        seq.num_kv_tokens += growth
        self.num_tokens_used += growth

    def free(self, seq: Sequence, *, keep_prefix: bool = True) -> None:
        """Release the sequence's slot. Its row stays reusable unless ``keep_prefix`` is False
        (the sequence failed: its keys and values may be NaN, and the runner zeroes the row)."""
        if seq.slot is None:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.release(seq.slot, keep=keep_prefix)
        self.num_tokens_used -= seq.num_kv_tokens
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = None
        seq.num_kv_tokens = 0
