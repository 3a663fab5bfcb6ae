"""Prefix reuse across requests, per slot row (pure Python, no torch), as llama.cpp does.

Each slot owns one contiguous KV row of ``max_model_len`` positions (``kv_cache.py``), so vLLM's
hashed blocks, shared by several sequences through a block table, do not fit: two sequences can
never read the same memory. Instead a slot row keeps its keys and values after its sequence
leaves, and this class remembers which tokens they belong to. A new sequence takes the free slot
whose row shares the longest prefix with its tokens and prefills only the rest; when a longer
prefix sits in another slot (a running sequence's, or a free row that it would be a pity to
overwrite) it is copied row to row first: a memory copy of ~46 MB for 1,000 SmolLM2 tokens
costs milliseconds where recomputing them costs seconds on a CPU.

With ``prefix_cache_rows`` the runner holds more rows than sequences may run (at most
``max_batch_size``): the spare rows keep the most recently finished prefixes, as vLLM keeps freed
blocks cached in its free pool until they are evicted, least recently used first. A new
sequence then copies a shared prefix out of a free row that holds more than it shares, rather
than overwrite that row's tail (the next turn of another conversation).

What a row holds is exact: a running sequence's row holds its first ``num_computed_tokens``
tokens; a freed row keeps what its sequence had computed. A row whose sequence failed is
forgotten (the runner zeroes it again: its values may be NaN). Positions past the reused prefix
still hold the previous owner's values; they are overwritten before they are read, and
attention masks every position past a sequence's own length.

Rows match only within a cache salt (``SamplingParams.cache_salt``: the gateway's tenant, and a
client's own vLLM ``cache_salt``): a row filled under one salt is never reused, copied from or
waited for by a sequence with another, so one tenant's time to first token says nothing about
what another tenant sent. A row can still be overwritten by any salt (eviction is not a leak).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from slotserve.engine.core.sequence import Sequence

# Reuse a free row in place, or copy from another row, only for this many shared tokens or more
# (vLLM's block size): a shorter match is not worth losing the rest of a row that holds, say, a
# system prompt, nor a copy.
MIN_REUSE_TOKENS = 16
# A request waits for a running sequence's prefix only when that saves at least this many
# tokens: waiting costs it a step (~100 ms on a CPU) where a few dozen tokens of prefill cost
# about as much, and far less on a GPU.
MIN_WAIT_TOKENS = 256


@dataclass(frozen=True, slots=True)
class SlotCopy:
    """Copy the keys and values of positions ``[0, num_tokens)`` from one slot row to another."""

    src_slot: int
    dst_slot: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class SlotChoice:
    """Where a new sequence goes: its slot, how many leading tokens it reuses, what to copy."""

    slot: int
    num_cached_tokens: int
    copies: tuple[SlotCopy, ...]


def common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a[:limit]`` and ``b[:limit]``.

    A binary search over slice comparisons: each comparison runs in C, so a 2,000-token prompt
    against 32 rows costs well under a millisecond.
    """
    high = min(len(a), len(b), limit)
    if high == 0 or a[0] != b[0]:
        return 0
    low = 1  # a[:low] == b[:low]
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class SlotPrefixCache:
    """Which tokens each slot row holds keys and values for; picks slots for new sequences."""

    def __init__(self, num_slots: int, *, spare_rows: bool = False) -> None:
        """``num_slots`` rows; ``spare_rows``: there are more rows than sequences may run
        (``prefix_cache_rows``), so a free row is worth keeping whole (see :meth:`choose`)."""
        self._spare_rows = spare_rows
        self._free_rows: list[list[int]] = [[] for _ in range(num_slots)]
        # The salt each free row was filled under: matched only by the same salt.
        self._free_salts: list[str | None] = [None] * num_slots
        self._owners: list[Sequence | None] = [None] * num_slots
        # When each free row was last released: the least recently used row is evicted first.
        self._released_at = [0] * num_slots
        self._clock = 0
        # The same moments in monotonic seconds: how long a row has sat unused (/load).
        self._used_at = [0.0] * num_slots
        # The request whose tokens each row holds (running, or the last to leave it): the
        # engine's /load names the prefix keys of these (prefix-aware routing in the gateway).
        self._row_requests: list[str | None] = [None] * num_slots

    @property
    def row_idle_since(self) -> tuple[float | None, ...]:
        """Per slot row, when it was last used (monotonic seconds) if it is free and holds a
        prefix; None for a running sequence's row or an empty one."""
        return tuple(
            at if owner is None and tokens else None
            for at, owner, tokens in zip(self._used_at, self._owners, self._free_rows, strict=True)
        )

    @property
    def row_requests(self) -> tuple[str | None, ...]:
        """Per slot row, the request whose tokens it holds (None: nothing reusable)."""
        return tuple(self._row_requests)

    def row_tokens(self, slot: int) -> list[int]:
        """The tokens whose keys and values slot row ``slot`` holds now (a copy)."""
        owner = self._owners[slot]
        if owner is not None:
            return owner.token_ids[: owner.num_computed_tokens]
        return list(self._free_rows[slot])

    def _match(self, slot: int, token_ids: list[int], limit: int, salt: str | None) -> int:
        owner = self._owners[slot]
        if owner is not None:
            if owner.params.cache_salt != salt:
                return 0
            return common_prefix_len(
                owner.token_ids, token_ids, min(limit, owner.num_computed_tokens)
            )
        if self._free_salts[slot] != salt:
            return 0
        return common_prefix_len(self._free_rows[slot], token_ids, limit)

    def choose(self, seq: Sequence, free_slots: list[int]) -> SlotChoice:
        """The slot for ``seq`` among ``free_slots`` (not empty), and what it can reuse.

        At most all tokens but the last are reused: the step must compute the last one to
        sample from its logits (fewer with prompt logprobs: ``Sequence.max_reusable_tokens``).
        """
        token_ids = seq.token_ids
        limit = seq.max_reusable_tokens
        salt = seq.params.cache_salt
        matches = {
            slot: self._match(slot, token_ids, limit, salt) for slot in range(len(self._owners))
        }
        best_free = max(free_slots, key=lambda slot: (matches[slot], -slot))
        # Of the rows holding as much, the most recently used is copied from: reading a row keeps
        # it (below), and a short prefix every row shares (a chat template's system prompt) would
        # otherwise keep the coldest row alive and evict a conversation that is coming back.
        best_any = max(
            matches,
            key=lambda slot: (matches[slot], slot in free_slots, self._released_at[slot], -slot),
        )
        free_len, any_len = matches[best_free], matches[best_any]
        if free_len >= MIN_REUSE_TOKENS and not self._would_cut(best_free, free_len, free_slots):
            dst = best_free
        else:
            dst = min(free_slots, key=self._eviction_order)
            free_len = matches[dst]
        if any_len >= MIN_REUSE_TOKENS and any_len >= free_len + MIN_REUSE_TOKENS:
            if self._spare_rows and self._owners[best_any] is None:
                self._touch(best_any)  # a row read is a row used: it is evicted later
            return SlotChoice(dst, any_len, (SlotCopy(best_any, dst, any_len),))
        return SlotChoice(dst, free_len, ())

    def _would_cut(self, slot: int, match: int, free_slots: list[int]) -> bool:
        # With spare rows, a free row that holds more than the shared prefix (another
        # conversation's history past a common system prompt) is copied from rather than
        # overwritten, unless it is the row to evict anyway: the least recently used row goes,
        # as vLLM evicts its free blocks, and a copy costs milliseconds where the lost tail
        # would cost a prefill. With one row per slot every row is soon taken again, so the
        # copy would save nothing: a row is reused in place, as before; but while an empty row
        # is free (a fresh engine) it takes the newcomer, so a conversation whose next turn
        # comes once another has ended still finds its history (it did not, on a busy machine
        # where two first turns ran one after the other: the second cut the first's row for the
        # chat template's 30-token system prompt).
        if len(self._free_rows[slot]) <= match:
            return False
        return self._spare_rows or any(not self._free_rows[free] for free in free_slots)

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._released_at[slot] = self._clock
        self._used_at[slot] = time.monotonic()

    def should_wait(self, seq: Sequence) -> bool:
        """Is a running sequence about to compute a prefix of ``seq`` at least
        ``MIN_WAIT_TOKENS`` longer than any row holds?

        Requests that arrive together with the same system prompt would otherwise all prefill
        it in the same steps; waiting for the first one's row and copying it costs that one's
        prefill, which a lone request pays anyway. A running sequence always makes progress (it
        is served before anyone is admitted), so the wait ends.
        """
        token_ids = seq.token_ids
        limit = seq.max_reusable_tokens
        salt = seq.params.cache_salt
        owners = [
            owner for owner in self._owners if owner is not None and owner.params.cache_salt == salt
        ]
        if not owners:
            return False
        reusable = max(
            self._match(slot, token_ids, limit, salt) for slot in range(len(self._owners))
        )
        for owner in owners:
            ahead = common_prefix_len(owner.token_ids, token_ids, limit)
            if ahead > owner.num_computed_tokens and ahead - reusable >= MIN_WAIT_TOKENS:
                return True
        return False

    def _eviction_order(self, slot: int) -> tuple[bool, int, int]:
        # Empty rows first, lowest first (live rows stay packed at the front of the cache); then
        # the row released longest ago.
        return (bool(self._free_rows[slot]), self._released_at[slot], slot)

    def occupy(self, slot: int, seq: Sequence) -> None:
        """``seq`` owns ``slot`` from now on; its row holds its first ``num_computed_tokens``."""
        self._owners[slot] = seq
        self._free_rows[slot] = []
        self._free_salts[slot] = None
        self._row_requests[slot] = seq.request_id

    def release(self, slot: int, *, keep: bool) -> None:
        """The slot's sequence left; with ``keep`` its row's tokens stay reusable."""
        owner = self._owners[slot]
        self._owners[slot] = None
        self._free_rows[slot] = (
            owner.token_ids[: owner.num_computed_tokens] if keep and owner is not None else []
        )
        self._free_salts[slot] = owner.params.cache_salt if keep and owner is not None else None
        if not self._free_rows[slot]:
            self._row_requests[slot] = None
        self._touch(slot)
