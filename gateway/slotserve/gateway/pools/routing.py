"""Pure routing rules: which endpoint gets the next request.

The Redis backend runs the same rules inside its Lua scripts (``admission/lua/scripts.py``); the
shared admission test suite checks that both backends agree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from slotserve.contracts.engine_load import MAX_ROW_IDLE_MS
from slotserve.contracts.pool_spec import MAX_PREFIX_CACHE_ROWS
from slotserve.contracts.prefix_keys import MAX_PREFIX_KEYS

# An engine's slots as offered: MaxBatchSize's bound (admission.types.MAX_ENGINE_SLOTS).
MAX_OFFER_SLOTS = 1024
# An engine's empty KV rows as offered: the prefix cache's bound (pool_spec.MAX_PREFIX_CACHE_ROWS).
MAX_OFFER_ROWS = MAX_PREFIX_CACHE_ROWS
# How long an engine's next row to give up has sat unused, as offered (its /load's bound).
MAX_OFFER_ROW_IDLE_MS = MAX_ROW_IDLE_MS
# How old an offer's report may be (older: the engine would be down long before).
MAX_OFFER_AGE_MS = 600_000


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
    # With no empty row: how long the row a new prefix would evict there has sat unused (its
    # /load's prefix_row_idle_ms; 0: none, or not known since a grant claimed it).
    row_idle_ms: int = 0
    # Milliseconds since this replica read the report (grants after it are not in it).
    report_age_ms: int = 0


def load_score(running: int, waiting: int, kv_cache_usage: float, slots_total: int) -> float:
    """Engine-reported load as one number, lower is better.

    Queued work at the engine weighs double (it delays everything behind it); KV usage breaks
    ties between engines with the same number of sequences.
    """
    slots = max(slots_total, 1)
    return (running + 2 * waiting) / slots + kv_cache_usage


def offer_is_sound(offer: EndpointOffer) -> bool:
    """Whether an offer can be routed to: 1..MAX_OFFER_SLOTS slots, a finite load, rows, idle
    and age within their bounds. Engines are
    untrusted input; an offer that is not sound is left out by both backends alike (the Lua
    scripts skip the same ones), so NaN never orders endpoints and no slot count is unbounded."""
    bounded = (
        (offer.slots_total, 1, MAX_OFFER_SLOTS),
        (offer.rows_free, 0, MAX_OFFER_ROWS),
        (offer.row_idle_ms, 0, MAX_OFFER_ROW_IDLE_MS),
        (offer.report_age_ms, 0, MAX_OFFER_AGE_MS),
    )
    return all(
        isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        for value, low, high in bounded
    ) and (isinstance(offer.load_score, int | float) and math.isfinite(offer.load_score))


def sound_offers(offers: Sequence[EndpointOffer]) -> list[EndpointOffer]:
    return [offer for offer in offers if offer_is_sound(offer)]


# A grant that sends a request to an engine holding none of its prefix takes a row there (an
# empty one, else the least recently used) before the engine's next /load shows it: a row claim
# (``P:{pool}:row_claims:{url}``), counted against every report read before it.
# A grant reaches its engine's queue within this (a report read this long after it shows it).
ROW_CLAIM_MARGIN_MS = 200
ROW_CLAIM_TTL_MS = 10_000  # kept this long; reports are polled every 0.25 s
# A request whose prefix no engine holds waits for a full engine only for a row unused this
# much longer than any an engine with room would give up (an empty row: always): rows a second
# apart are alike (a conversation thinks for longer between its turns).
COLDER_BY_MS = 1_000


def claim_cutoff_us(offer: EndpointOffer, now_us: int) -> int:
    """Claims granted after this moment are not in ``offer``'s report yet."""
    return now_us - (offer.report_age_ms + ROW_CLAIM_MARGIN_MS) * 1000


def with_claims(offer: EndpointOffer, claims: int) -> EndpointOffer:
    """``offer`` less ``claims`` rows taken since its report: its empty rows first; the row it
    would evict next is then not known (idle 0), so no second new prefix is sent to evict it."""
    if claims <= 0:
        return offer
    return replace(offer, rows_free=max(0, offer.rows_free - claims), row_idle_ms=0)


def coldness(offer: EndpointOffer) -> tuple[int, int]:
    """What a new prefix gives up at ``offer``, higher is better: its empty rows, then how
    long the row it would evict has sat unused."""
    return offer.rows_free, offer.row_idle_ms


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
    matched), else the session's engine (``session_url``), else the coldest engine (``coldness``:
    the most empty rows, where the request's prefix evicts nobody's; else the row unused
    longest, as one cache of all the engines' rows would evict), each only while within the
    route's balance of the least loaded; else the least loaded. Returns it, why, and its
    depth."""
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
    best_cold = (0, 0)
    for offer in ranked:  # ties: the first, least loaded
        if coldness(offer) > best_cold and balanced(offer):
            best, best_cold = offer, coldness(offer)
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
    ``coldest_full``) are all full, and
    one of them would be within the route's balance of ``least`` (the least loaded engine with
    room) once ``need`` slots free there. The caller bounds the wait (``Route.wait_ms``) and lets
    the requests behind it pass meanwhile (``lua/cache_wait.py``)."""
    deepest = max((depths.get(offer.url, 0) for offer in offers), default=0)
    if deepest > 0:
        holders = [offer for offer in offers if depths.get(offer.url, 0) == deepest]
    elif session_url:
        holders = [offer for offer in offers if offer.url == session_url]
    else:
        holders = coldest_full(offers, inflight, need)
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


def coldest_full(
    offers: Sequence[EndpointOffer], inflight: Mapping[str, int], need: int
) -> list[EndpointOffer]:
    """The full engines a request whose prefix no engine holds would rather wait for: those
    with the most empty rows while no engine with room for ``need`` slots has one; with no
    empty row anywhere, those whose next row to evict has sat unused longest, when that is
    ``COLDER_BY_MS`` longer than at any engine with room (as one cache of all the engines' rows
    would evict). Else none: it goes where there is room now. It would otherwise take a row
    from a conversation that is coming back."""
    room = [o for o in offers if inflight.get(o.url, 0) + need <= o.slots_total]
    best_room = max((coldness(o) for o in room), default=(0, 0))
    if best_room[0] > 0:
        return []
    full = [o for o in offers if inflight.get(o.url, 0) + need > o.slots_total]
    most = max((o.rows_free for o in full), default=0)
    if most > 0:
        return [o for o in full if o.rows_free == most]
    coldest = max((o.row_idle_ms for o in full), default=0)
    if coldest <= best_room[1] + COLDER_BY_MS:
        return []
    return [o for o in full if o.row_idle_ms == coldest]
