"""Recent routings, sessions and row claims of one pool in the in-process backend: what the Redis
backend keeps under ``P:{pool}:routed:{key}``, ``P:{pool}:session:{id}`` and
``P:{pool}:row_claims:{url}`` (``lua/routes.py``), with the same TTLs, read and written at the
same steps."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from slotserve.gateway.pools.routing import (
    ROUTED_TTL_MS,
    ROW_CLAIM_TTL_MS,
    SESSION_TTL_MS,
    EndpointOffer,
    Route,
    claim_cutoff_us,
    recorded_keys,
    with_claims,
)

SWEEP_BATCH = 10_000  # each grant pushes up to 33 records: pops keep pace with pushes


@dataclass
class RouteMemory:
    routed: dict[str, tuple[str, int]] = field(default_factory=dict)  # key -> (url, expiry us)
    sessions: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (url, expiry us)
    _expiries: list[tuple[int, bool, str]] = field(default_factory=list)  # (us, session?, name)
    claims: dict[str, deque[int]] = field(default_factory=dict)  # url -> grant times, us

    def with_claims(self, offers: Sequence[EndpointOffer], now_us: int) -> list[EndpointOffer]:
        """``offers`` less the rows claimed since each one's report (``routing.with_claims``)."""
        out = []
        for offer in offers:
            cutoff, claims = claim_cutoff_us(offer, now_us), 0
            for at in reversed(self.claims.get(offer.url, ())):  # newest first
                if at <= cutoff:
                    break
                claims += 1
            out.append(with_claims(offer, claims))
        return out

    def depths(self, route: Route, now_us: int) -> dict[str, int]:
        """Url -> keys matched: the engines' reports, and what was routed lately (each key of
        the chain that was routed to an engine counts its depth there)."""
        out = dict(route.depths)
        for depth, key in enumerate(route.keys, start=1):
            hit = self.routed.get(key)
            if hit is not None and hit[1] > now_us:
                out[hit[0]] = max(out.get(hit[0], 0), depth)
        return out

    def session_url(self, route: Route, now_us: int) -> str:
        hit = self.sessions.get(route.session) if route.session else None
        return hit[0] if hit is not None and hit[1] > now_us else ""

    def granted(self, route: Route, url: str, now_us: int, new_row: bool) -> None:
        """``route``'s request granted to ``url``; ``new_row``: no row there held its prefix."""
        if new_row:
            self.claims.setdefault(url, deque()).append(now_us)
        expiry = now_us + ROUTED_TTL_MS * 1000
        for key in recorded_keys(route.keys):
            self.routed[key] = (url, expiry)
            heapq.heappush(self._expiries, (expiry, False, key))
        if route.session:
            expiry = now_us + SESSION_TTL_MS * 1000
            self.sessions[route.session] = (url, expiry)
            heapq.heappush(self._expiries, (expiry, True, route.session))

    def sweep(self, now_us: int) -> None:
        """Expired records go, as Redis expires its keys (a batch a step)."""
        for url, times in list(self.claims.items()):
            while times and times[0] <= now_us - ROW_CLAIM_TTL_MS * 1000:
                times.popleft()
            if not times:
                del self.claims[url]
        for _ in range(SWEEP_BATCH):
            if not self._expiries or self._expiries[0][0] > now_us:
                return
            expiry, is_session, name = heapq.heappop(self._expiries)
            table = self.sessions if is_session else self.routed
            if name in table and table[name][1] <= expiry:
                del table[name]

    def clear(self) -> None:
        self.routed.clear()
        self.sessions.clear()
        self._expiries.clear()
        self.claims.clear()
