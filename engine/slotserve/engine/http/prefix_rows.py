"""The prefix keys of what the engine's slot rows hold, for ``GET /load`` (prefix-aware routing).

A request's keys (``contracts.prefix_keys``) are noted when it starts; when it finishes, its row
also holds its answer, so its keys become those of the conversation with the answer as the next
assistant message (``with_answer``): the next turn of a chat matches at the depth of its whole
history. The engine's prefix cache names, per slot row, the request whose tokens the row holds
(``EngineStats.row_request_ids``); a row overwritten by another request reports that request's
keys from the next ``/load`` on, so eviction is exact.

Everything here runs on the event loop; the keys of requests no row names any more are dropped
at each report, and at most ``MAX_NOTED`` requests are remembered in between.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from slotserve.contracts.engine_load import MAX_REPORTED_PREFIX_KEYS
from slotserve.contracts.prefix_keys import PrefixChain, with_answer

MAX_NOTED = 4096
# Keys reported per row at most: its first key (a shared system prompt) and its deepest ones (a
# conversation's history); an engine with many slots reports fewer per row (the report's bound).
MAX_KEYS_PER_ROW = 8


def row_keys(keys: tuple[str, ...], budget: int) -> tuple[str, ...]:
    """At most ``budget`` of a row's keys: the first and the deepest."""
    if len(keys) <= budget:
        return keys
    if budget <= 1:
        return keys[-1:]
    return (keys[0], *keys[len(keys) - budget + 1 :])


class PrefixRows:
    """Request id -> the prefix keys its row holds."""

    def __init__(self, max_noted: int = MAX_NOTED) -> None:
        self._keys: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._active: set[str] = set()  # started, not ended: kept while they wait for a slot
        self.max_noted = max_noted

    def started(self, request_ids: Sequence[str], chain: PrefixChain) -> None:
        if not chain.keys:
            return
        for request_id in request_ids:
            self._active.add(request_id)
            self._note(request_id, chain.keys)

    def finished(self, request_id: str, chain: PrefixChain, answer: str) -> None:
        """The request's row now holds its answer too (only a request that ended well)."""
        if chain.keys:
            self._note(request_id, with_answer(chain, answer))

    def ended(self, request_ids: Sequence[str]) -> None:
        self._active.difference_update(request_ids)

    def _note(self, request_id: str, keys: tuple[str, ...]) -> None:
        self._keys[request_id] = keys
        self._keys.move_to_end(request_id)
        while len(self._keys) > self.max_noted:
            self._keys.popitem(last=False)

    def report(self, row_request_ids: Sequence[str | None]) -> list[str]:
        """The keys the rows hold now (each once), within ``MAX_REPORTED_PREFIX_KEYS``; the
        keys of requests no row holds are forgotten."""
        held = {rid for rid in row_request_ids if rid is not None}
        gone = [rid for rid in self._keys if rid not in held and rid not in self._active]
        for stale in gone:
            del self._keys[stale]
        budget = max(1, min(MAX_KEYS_PER_ROW, MAX_REPORTED_PREFIX_KEYS // max(1, len(held))))
        out: dict[str, None] = {}
        for row_request in row_request_ids:
            keys = self._keys.get(row_request) if row_request is not None else None
            if keys:
                out.update(dict.fromkeys(row_keys(keys, budget)))
        return list(out)[:MAX_REPORTED_PREFIX_KEYS]
