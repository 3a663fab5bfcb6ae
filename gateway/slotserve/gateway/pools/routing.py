"""Pure routing rules: which endpoint gets the next request.

The Redis backend runs the same rules inside its Lua scripts (``admission/lua/scripts.py``); the
shared admission test suite checks that both backends agree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from slotserve.contracts.pool_spec import MAX_PREFIX_CACHE_ROWS
from slotserve.contracts.prefix_keys import MAX_PREFIX_KEYS

# An engine's slots as offered: MaxBatchSize's bound (admission.types.MAX_ENGINE_SLOTS).
MAX_OFFER_SLOTS = 1024
# An engine's empty KV rows as offered: the prefix cache's bound (pool_spec.MAX_PREFIX_CACHE_ROWS).
MAX_OFFER_ROWS = MAX_PREFIX_CACHE_ROWS


@dataclass(frozen=True)
class EndpointOffer:
    """An endpoint that may receive requests, as this gateway replica last saw it."""

    url: str
    slots_total: int
    load_score: float
    # The engine's recent mean seconds a request holds a slot (its /load; 0: none finished).
    mean_request_s: float = 0.0
    # KV rows that hold nothing yet, less the requests waiting there for a slot (its /load's
    # prefix_rows_free): a request whose prefix no engine holds fills one without evicting.
    rows_free: int = 0


def load_score(running: int, waiting: int, kv_cache_usage: float, slots_total: int) -> float:
    """Engine-reported load as one number, lower is better.

    Queued work at the engine weighs double (it delays everything behind it); KV usage breaks
    ties between engines with the same number of sequences.
    """
    slots = max(slots_total, 1)
    return (running + 2 * waiting) / slots + kv_cache_usage


def offer_is_sound(offer: EndpointOffer) -> bool:
    """Whether an offer can be routed to: 1..MAX_OFFER_SLOTS slots, a finite load. Engines are
    untrusted input; an offer that is not sound is left out by both backends alike (the Lua
    scripts skip the same ones), so NaN never orders endpoints and no slot count is unbounded."""
    slots, rows = offer.slots_total, offer.rows_free
    return (
        isinstance(slots, int)
        and not isinstance(slots, bool)
        and 1 <= slots <= MAX_OFFER_SLOTS
        and isinstance(offer.load_score, int | float)
        and math.isfinite(offer.load_score)
        and isinstance(rows, int)
        and not isinstance(rows, bool)
        and 0 <= rows <= MAX_OFFER_ROWS
    )


def sound_offers(offers: Sequence[EndpointOffer]) -> list[EndpointOffer]:
    return [offer for offer in offers if offer_is_sound(offer)]


def most_slots(offers: Sequence[EndpointOffer]) -> int:
    """The most slots any sound offer has (0: none): a request needing more fits nowhere."""
    return max((offer.slots_total for offer in sound_offers(offers)), default=0)


def rank_endpoints(
    offers: Sequence[EndpointOffer],
    inflight: Mapping[str, int],
    *,
    need: int = 1,
) -> list[EndpointOffer]:
    """Endpoints with ``need`` free slots (a request's ``n``), least loaded first.

    Load is first the share of slots the gateways hold in flight (exact and current, shared by all
    replicas), then the engine's own report, then the URL so that every replica agrees. Every
    batching policy is routed alike: the engine forms static and dynamic batches itself from what
    arrives, so the gateway never holds a request back while an endpoint has room for it.
    """
    eligible = [
        offer
        for offer in sound_offers(offers)
        if inflight.get(offer.url, 0) + need <= offer.slots_total
    ]
    return sorted(
        eligible,
        key=lambda o: (inflight.get(o.url, 0) / o.slots_total, o.load_score, o.url),
    )


# Prefix-aware routing (docs/gateway.md). A route travels with a queued request (the Redis
# backend stores its text, ``encode``); the Lua scripts (``admission/lua/routes.py``) decode and
# apply the same rule as ``pick_endpoint``.
ROUTE_SEPARATOR, ROUTE_ITEM = "\x1e", "\x1f"
MAX_ROUTE_DEPTHS = 16  # engines named with a matched depth (those with the deepest matches)
MAX_ROUTE_CHARS = 16_384
SESSION_HEX = 32  # a session key reaches Redis as this many hex digits of its hash
# "Routed keys K to engine E" lasts until E's /load shows them (polled every 0.25 s) and a while
# more; a session's engine is remembered between a conversation's turns.
ROUTED_TTL_MS = 5_000
SESSION_TTL_MS = 600_000
# Waiting for the engine that holds a request's prefix (``waits_for_engine``): at most this long
# (``RoutingSpec.cache_wait_milliseconds``), while at most this many behind it pass it.
MAX_CACHE_WAIT_MS = 60_000
# The wait while no engine of the pool has reported a mean request time (``cache_wait_ms``).
COLD_CACHE_WAIT_MS = 2_000
MAX_LOOK_AHEAD = 32
RouteOutcome = Literal["prefix", "session", "rows", "load"]
_HEX = re.compile(r"[0-9a-f]*")


@dataclass(frozen=True)
class Route:
    """What may prefer one engine for a request: its prefix keys, how many of them each
    engine's rows hold (its /load), its session, and how far from the least loaded engine a
    preferred one may be (``balance_permille``: per mille of slots in flight); how long it may
    wait for a full engine holding its prefix (``wait_ms``, 0: never), and how many requests
    behind it are looked at meanwhile (``look_ahead``, 0: none, so it never waits)."""

    keys: tuple[str, ...] = ()
    depths: tuple[tuple[str, int], ...] = ()
    session: str = ""
    balance_permille: int = 500
    wait_ms: int = 0
    look_ahead: int = 0

    def encode(self) -> str:
        """The text the Redis scripts read (``lua/routes.py``): balance, session, url/depth
        pairs, keys, wait, look-ahead; fields apart by \\x1e, items by \\x1f."""
        pairs = ROUTE_ITEM.join(f"{url}{ROUTE_ITEM}{depth}" for url, depth in self.depths)
        return ROUTE_SEPARATOR.join(
            (
                str(self.balance_permille),
                self.session,
                pairs,
                ROUTE_ITEM.join(self.keys),
                str(self.wait_ms),
                str(self.look_ahead),
            )
        )

    @property
    def may_wait(self) -> bool:
        """Whether it may wait for the engine holding its prefix (``waits_for_engine``)."""
        return self.wait_ms > 0 and self.look_ahead > 0


def sendable_route(route: Route | None) -> Route | None:
    """``route`` as both backends apply it: what the Lua reads of its text
    (``lua/routes.py``'s ``decode_route``): keys of 16 hex digits (the first 32), depths 1..32
    (the first 16 engines), no separator in a URL; None when its balance, session, wait or
    look-ahead cannot be read, or its text is longer than ``MAX_ROUTE_CHARS`` bytes."""
    if route is None or not 0 <= route.balance_permille <= 1000:
        return None
    if not 0 <= route.wait_ms <= MAX_CACHE_WAIT_MS or not 0 <= route.look_ahead <= MAX_LOOK_AHEAD:
        return None
    if len(route.session) > SESSION_HEX or not _HEX.fullmatch(route.session):
        return None
    keys = tuple(key for key in route.keys if len(key) == 16 and _HEX.fullmatch(key))
    depths = tuple(
        (url, depth)
        for url, depth in route.depths[:MAX_ROUTE_DEPTHS]
        if 1 <= depth <= MAX_PREFIX_KEYS and ROUTE_ITEM not in url and ROUTE_SEPARATOR not in url
    )
    clean = Route(
        keys[:MAX_PREFIX_KEYS],
        depths,
        route.session,
        route.balance_permille,
        route.wait_ms,
        route.look_ahead,
    )
    if len(clean.encode().encode()) > MAX_ROUTE_CHARS:
        return None
    return clean


def cache_wait_ms(
    cap_ms: int,
    turnovers: float,
    offers: Sequence[EndpointOffer],
    depths: Mapping[str, int],
) -> int:
    """How long a request may wait for the full engine holding its prefix (``Route.wait_ms``):
    ``turnovers`` of that engine's slot turnover, at most ``cap_ms``. An engine's turnover is its
    mean request seconds over its slots, the mean time between two of its slots freeing (the
    deepest match's engines, else every engine: a session's engine is known only to Redis).
    While none has finished a request yet, ``COLD_CACHE_WAIT_MS``; ``turnovers`` 0: ``cap_ms``."""
    if cap_ms <= 0 or turnovers <= 0:
        return max(0, cap_ms)
    sound = sound_offers(offers)
    deepest = max((depths.get(offer.url, 0) for offer in sound), default=0)
    holders = [o for o in sound if deepest == 0 or depths.get(o.url, 0) == deepest]
    gaps = [
        o.mean_request_s / o.slots_total
        for o in holders
        if math.isfinite(o.mean_request_s) and o.mean_request_s > 0
    ]
    if not gaps:
        return min(cap_ms, COLD_CACHE_WAIT_MS)
    wait_ms = turnovers * 1000 * sum(gaps) / len(gaps)
    return max(1, min(cap_ms, math.ceil(wait_ms)))


def recorded_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    """The keys a grant records as routed (``P:{pool}:routed:{key}``): the first (a shared
    system prompt or document) and the deepest (the conversation so far). Two writes a grant
    whatever the depth; the engines' /load covers the rest within a poll."""
    return keys[:1] + keys[-1:] if len(keys) > 1 else keys


def within_balance(
    used: int, slots: int, least_used: int, least_slots: int, balance_permille: int
) -> bool:
    """``used / slots - least_used / least_slots <= balance_permille / 1000``, in integers so
    that Lua's doubles and Python agree exactly."""
    return (
        used * least_slots - least_used * slots
    ) * 1000 <= balance_permille * slots * least_slots


def pick_endpoint(
    ranked: Sequence[EndpointOffer],
    inflight: Mapping[str, int],
    route: Route | None,
    depths: Mapping[str, int],
    session_url: str = "",
) -> tuple[EndpointOffer, RouteOutcome, int]:
    """Among ``ranked`` (``rank_endpoints``: room for the request, least loaded first; not
    empty), the engine a route prefers: the deepest matched prefix (``depths``, url -> keys
    matched), else the session's engine (``session_url``), else the engine with the most empty
    rows (``EndpointOffer.rows_free``: the request's prefix evicts nobody's there), each only
    while within the route's balance of the least loaded; else the least loaded. Returns it,
    why, and its depth."""
    least = ranked[0]
    if route is None:
        return least, "load", 0
    least_used = inflight.get(least.url, 0)

    def balanced(offer: EndpointOffer) -> bool:
        used = inflight.get(offer.url, 0)
        return within_balance(
            used, offer.slots_total, least_used, least.slots_total, route.balance_permille
        )

    best, best_depth = None, 0
    for offer in ranked:  # ties on depth: the first, least loaded
        depth = depths.get(offer.url, 0)
        if depth > best_depth and balanced(offer):
            best, best_depth = offer, depth
    if best is not None:
        return best, "prefix", best_depth
    for offer in ranked:
        if session_url and offer.url == session_url and balanced(offer):
            return offer, "session", 0
    best_rows = 0
    for offer in ranked:  # ties on rows: the first, least loaded
        if offer.rows_free > best_rows and balanced(offer):
            best, best_rows = offer, offer.rows_free
    if best is not None:
        return best, "rows", 0
    return least, "load", 0


def waits_for_engine(
    offers: Sequence[EndpointOffer],
    inflight: Mapping[str, int],
    route: Route,
    depths: Mapping[str, int],
    session_url: str,
    need: int,
    least: EndpointOffer,
) -> bool:
    """Whether a request would rather wait than go where there is room: the engines holding its
    deepest match among all ``offers`` (none matched: its session's engine; no session either,
    the engines with the most empty rows while no engine with room has one) are all full, and
    one of them would be within the route's balance of ``least`` (the least loaded engine with
    room) once ``need`` slots free there. The caller bounds the wait (``Route.wait_ms``) and lets
    the requests behind it pass meanwhile (``lua/cache_wait.py``)."""
    deepest = max((depths.get(offer.url, 0) for offer in offers), default=0)
    if deepest > 0:
        holders = [offer for offer in offers if depths.get(offer.url, 0) == deepest]
    elif session_url:
        holders = [offer for offer in offers if offer.url == session_url]
    else:
        holders = roomiest_full(offers, inflight, need)
    if any(inflight.get(offer.url, 0) + need <= offer.slots_total for offer in holders):
        return False
    least_used = inflight.get(least.url, 0)
    return any(
        need <= offer.slots_total
        and within_balance(
            offer.slots_total - need,
            offer.slots_total,
            least_used,
            least.slots_total,
            route.balance_permille,
        )
        for offer in holders
    )


def roomiest_full(
    offers: Sequence[EndpointOffer], inflight: Mapping[str, int], need: int
) -> list[EndpointOffer]:
    """The engines with the most empty rows, when no engine with room for ``need`` slots has
    one (else none: the request fills an empty row where it can go now). A request whose prefix
    no engine holds would otherwise take a row from a conversation that is coming back."""
    if any(
        offer.rows_free > 0 and inflight.get(offer.url, 0) + need <= offer.slots_total
        for offer in offers
    ):
        return []
    most = max((offer.rows_free for offer in offers), default=0)
    return [offer for offer in offers if most > 0 and offer.rows_free == most]
