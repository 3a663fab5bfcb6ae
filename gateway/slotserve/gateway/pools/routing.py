"""Pure routing rules: which endpoint gets the next request.

The Redis backend runs the same rules inside its Lua scripts (``admission/lua/scripts.py``); the
shared admission test suite checks that both backends agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# An engine's slots as offered: MaxBatchSize's bound (admission.types.MAX_ENGINE_SLOTS).
MAX_OFFER_SLOTS = 1024


@dataclass(frozen=True)
class EndpointOffer:
    """An endpoint that may receive requests, as this gateway replica last saw it."""

    url: str
    slots_total: int
    load_score: float
    # The engine's recent mean seconds a request holds a slot (its /load; 0: none finished).
    mean_request_s: float = 0.0


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
    slots = offer.slots_total
    return (
        isinstance(slots, int)
        and not isinstance(slots, bool)
        and 1 <= slots <= MAX_OFFER_SLOTS
        and isinstance(offer.load_score, int | float)
        and math.isfinite(offer.load_score)
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
