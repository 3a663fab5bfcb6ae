"""Preemption for a tenant under its share (issue 26): the in-process twin of ``lua/preempt.py``.

Under a flood every slot is held, so a tenant at its share waits for the next answer to end
however well the fair order places it. vLLM's scheduler preempts a running sequence when a
request it must serve finds no room; here the gateway decides *who* may preempt *whom*, across
every replica, in the same atomic dispatch step as the fair order:

The head of the fair order needs one slot and no engine has one free. Its tenant ``h`` is under
its weighted share of the pool's slots: ``held(h) * W < S * w(h)``, where ``S`` is the slots of
the pool's sound offers and ``W`` the summed weights of the tenants holding slots in the pool and
of ``h`` (the tenants that compete for the slots now; one waiting behind ``h`` gets its own
turn when it is the head). An engine is a candidate when exactly all its slots are held
(``inflight == slots``: none of its slots is free and no preemption is outstanding on it, so an
engine gets at most ``slots + 1`` requests) and some other tenant holding a slot on it is over its
share (``held(v) * W > S * w(v)``). Among the candidates the least loaded (engine load, then URL,
as ``routing.rank_endpoints`` breaks ties) is granted, and its victim is the tenant on it that is
most over its share (``held / weight`` highest, then name). Integer arithmetic throughout, so
Lua and Python decide alike.

With one tenant nothing is ever preempted (it cannot be under and over its share at once), so
the pool setting (``AdmissionSpec.preempt_for_share``) defaults to on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slotserve.gateway.pools.routing import EndpointOffer, sound_offers

# Between a grant's URL and its victim tenant in what a backend delivers (``Admission._on_grant``
# splits it off; a URL never holds this character).
PREEMPT_MARK = "\x1e"


@dataclass(frozen=True)
class Preemption:
    """A preempting grant: one slot on ``offer``, taken from a sequence of ``victim``."""

    offer: EndpointOffer
    victim: str


def split_grant(delivered: str) -> tuple[str, str | None]:
    """A delivered endpoint as (URL, victim tenant or None)."""
    url, mark, victim = delivered.partition(PREEMPT_MARK)
    return url, (victim if mark and victim else None)


def pick_preemption(
    offers: Sequence[EndpointOffer],
    inflight: Mapping[str, int],
    held: Mapping[str, int],
    held_at: Mapping[tuple[str, str], int],
    weights: Mapping[str, int],
    tenant: str,
) -> Preemption | None:
    """The preempting grant the rule gives ``tenant``'s one-slot request, or None.

    ``held``: slots each tenant holds in the pool; ``held_at``: per (tenant, URL);
    ``weights``: each tenant's weight (absent: 1).
    """
    offers = sound_offers(offers)
    total = sum(offer.slots_total for offer in offers)
    holding = [t for t, n in held.items() if n > 0]
    total_weight = sum(weights.get(t, 1) for t in {*holding, tenant})
    if held.get(tenant, 0) * total_weight >= total * weights.get(tenant, 1):
        return None  # at or over its share: it waits for an answer to end

    def over(t: str) -> bool:
        return held[t] * total_weight > total * weights.get(t, 1)

    def more_over(a: str, b: str) -> bool:  # held / weight higher, then the name
        left, right = held[a] * weights.get(b, 1), held[b] * weights.get(a, 1)
        return left > right or (left == right and a < b)

    best: tuple[EndpointOffer, str] | None = None
    for offer in offers:
        if inflight.get(offer.url, 0) != offer.slots_total:
            continue
        victim = None
        for t in holding:
            on_it = t != tenant and held_at.get((t, offer.url), 0) > 0
            if on_it and over(t) and (victim is None or more_over(t, victim)):
                victim = t
        if victim is None:
            continue
        if best is None or (offer.load_score, offer.url) < (best[0].load_score, best[0].url):
            best = (offer, victim)
    return None if best is None else Preemption(*best)
