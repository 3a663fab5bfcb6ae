"""Preemption for a tenant under its share (issue 26): the in-process twin of ``lua/preempt.py``.

Under a flood every slot is held, so a tenant at its share waits for the next answer to end
however well the fair order places it. vLLM's scheduler preempts a running sequence when a
request it must serve finds no room; here the gateway decides *who* may preempt *whom*, across
every replica, in the same atomic dispatch step as the fair order.

The head of the fair order (tenant ``h``, at level ``L``) needs one slot and no engine has one
free. ``S`` is the slots of the pool's sound offers, ``W`` the summed weights of the tenants
holding slots in the pool and of ``h``; a tenant's *excess* is ``held * W - S * weight`` (its
held slots beyond its weighted share, in ``1/W`` slots) and it is *backlogged* when more than its
share of slots and one more wait at ``L``: ``F - V > FAIR_UNIT * S // W + FAIR_UNIT // weight``
(its finish tag beyond the level's virtual time, ``fair_share.py``, is at least its waiting
slots times ``FAIR_UNIT // weight``; more when some of its requests left the queue unserved).
``h`` may take a slot from a tenant ``v`` when either

- **reclaim**: ``h`` is under its share (excess < 0) and ``v`` over it (excess > 0), and ``v``
  is over by more than one slot (excess > W) unless ``h`` is not backlogged; or
- **borrow**: ``h`` is not backlogged (a light tenant, not a flooder) and at or under its share
  (excess <= 0), and ``v`` is backlogged and at or over its share (excess >= 0).

So a light tenant at its share borrows one slot from a flooder (it never holds more than its
share + 1 by preempting), and a backlogged tenant under its share never takes that one slot
back: a flooder reclaims only from a tenant more than one slot over. No thrash: a borrow needs a
backlogged victim and a non-backlogged preemptor, a backlogged reclaim a victim two slots over.

Who: the fair order's head first; when it may not preempt (a flooder's request, say), the first
of its level's first ``PREEMPT_SCAN`` entries in fair order whose tenant may (each tenant judged
by its first live one-slot entry there). A light tenant's second request in a short while starts
one slot's tag after its first, often level with or behind the flooder's head, which waits for an
answer to end; without the scan it would wait there too.

Where: an engine with every slot held and fewer than ``max_outstanding(slots)`` preemptions
outstanding (``slots <= inflight < slots + max(1, slots // 2)``; ``inflight - slots`` are
preempted answers waiting there for a slot) on which ``v`` holds more slots than are
outstanding (so it still runs one). Among the candidates the fewest outstanding, then the least
loaded (engine load, then URL); on it the victim is the allowed tenant most over its share
(``held / weight`` highest, then name). Integer arithmetic throughout, so Lua and Python decide
alike.

With one tenant nothing is ever preempted (its excess is never both below and above 0), so the
pool setting (``AdmissionSpec.preempt_for_share``) defaults to on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slotserve.gateway.admission.fair_share import FAIR_UNIT, V_FIELD, fair_cost
from slotserve.gateway.pools.routing import EndpointOffer, sound_offers

# Between a grant's URL and its victim tenant in what a backend delivers (``Admission._on_grant``
# splits it off; a URL never holds this character).
PREEMPT_MARK = "\x1e"
# When the fair order's head may not preempt, the first this many entries of its level (in fair
# order, the head's included) are looked at for one whose tenant may: bounded work per step.
PREEMPT_SCAN = 8


@dataclass(frozen=True)
class Preemption:
    """A preempting grant: one slot on ``offer``, taken from a sequence of ``victim``."""

    offer: EndpointOffer
    victim: str


def split_grant(delivered: str) -> tuple[str, str | None]:
    """A delivered endpoint as (URL, victim tenant or None)."""
    url, mark, victim = delivered.partition(PREEMPT_MARK)
    return url, (victim if mark and victim else None)


def max_outstanding(slots: int) -> int:
    """Preempting grants an engine of ``slots`` may have outstanding at once (its answers paused
    for a preemptor, waiting there for a slot): half its slots, at least one."""
    return max(1, slots // 2)


def pick_preemption(
    offers: Sequence[EndpointOffer],
    inflight: Mapping[str, int],
    held: Mapping[str, int],
    held_at: Mapping[tuple[str, str], int],
    weights: Mapping[str, int],
    tenant: str,
    fair_fields: Mapping[str, int],
) -> Preemption | None:
    """The preempting grant the rule gives ``tenant``'s one-slot request, or None.

    ``held``: slots each tenant holds in the pool; ``held_at``: per (tenant, URL);
    ``weights``: each tenant's weight (absent: 1); ``fair_fields``: the fair state of the
    request's level (``FairLevel.fields``: V and the tenants' finish tags; empty: none).
    """
    offers = sound_offers(offers)
    total = sum(offer.slots_total for offer in offers)
    holding = [t for t, n in held.items() if n > 0]
    total_weight = sum(weights.get(t, 1) for t in {*holding, tenant})
    backlog_bound = FAIR_UNIT * total // total_weight
    virtual_time = fair_fields.get(V_FIELD, 0)

    def excess(t: str) -> int:
        return held.get(t, 0) * total_weight - total * weights.get(t, 1)

    def backlogged(t: str) -> bool:
        lead = fair_fields.get(t, 0) - virtual_time
        return lead > backlog_bound + fair_cost(1, weights.get(t, 1))

    light = not backlogged(tenant)
    reclaim, borrow = excess(tenant) < 0, light and excess(tenant) <= 0
    if not (reclaim or borrow):
        return None  # over its share, or a flooder at it: it waits for an answer to end

    def may_take(t: str) -> bool:
        over = excess(t)
        if reclaim and over > 0 and (light or over > total_weight):
            return True
        return borrow and over >= 0 and backlogged(t)

    def more_over(a: str, b: str) -> bool:  # held / weight higher, then the name
        left, right = held[a] * weights.get(b, 1), held[b] * weights.get(a, 1)
        return left > right or (left == right and a < b)

    victims = [t for t in holding if t != tenant and may_take(t)]
    best: tuple[tuple[int, float, str], EndpointOffer, str] | None = None
    for offer in offers:
        outstanding = inflight.get(offer.url, 0) - offer.slots_total
        if outstanding < 0 or outstanding >= max_outstanding(offer.slots_total):
            continue
        victim = None
        for t in victims:
            if held_at.get((t, offer.url), 0) > outstanding and (
                victim is None or more_over(t, victim)
            ):
                victim = t
        if victim is None:
            continue
        rank = (outstanding, offer.load_score, offer.url)
        if best is None or rank < best[0]:
            best = (rank, offer, victim)
    return None if best is None else Preemption(best[1], best[2])
