"""The preemption rule itself (``preempt_share.pick_preemption``, issue 26): reclaim, borrow,
the hysteresis that keeps a flooder from taking a borrowed slot back, and the outstanding cap.
Pure function, no backend: the backends' agreement is the fuzz's (``test_gateway_admission_fuzz``).

One engine of 4 slots, tenants A and B of weight 1 (shares of 2 slots); a backlog is written as
the fair state of the request's level: V and each tenant's finish tag F.
"""

from __future__ import annotations

from slotserve.gateway.admission.fair_share import FAIR_UNIT, V_FIELD
from slotserve.gateway.admission.preempt_share import max_outstanding, pick_preemption
from slotserve.gateway.pools.routing import EndpointOffer

ENGINE = EndpointOffer("http://e", 4, 0.0)


def _fair(**waiting: int) -> dict[str, int]:
    """A level's fair state where each tenant has that many one-slot requests waiting."""
    return {V_FIELD: 10 * FAIR_UNIT, **{t: (10 + n) * FAIR_UNIT for t, n in waiting.items()}}


def _victim(held: dict[str, int], tenant: str, fair: dict[str, int], inflight: int = 4):
    held_at = {(t, ENGINE.url): n for t, n in held.items()}
    grant = pick_preemption([ENGINE], {ENGINE.url: inflight}, held, held_at, {}, tenant, fair)
    return None if grant is None else grant.victim


def test_a_light_tenant_under_its_share_reclaims_from_anyone_over_it():
    assert _victim({"a": 3, "b": 1}, "b", _fair(b=1)) == "a"  # A one over, no backlog
    assert _victim({"a": 4}, "b", _fair(b=1)) == "a"


def test_a_light_tenant_at_its_share_borrows_only_from_a_backlogged_one():
    assert _victim({"a": 2, "b": 2}, "b", _fair(a=16, b=1)) == "a"
    assert _victim({"a": 2, "b": 2}, "b", _fair(a=3, b=1)) is None  # A's share + 1 waits: light
    assert _victim({"a": 2, "b": 2}, "b", _fair(a=16, b=4)) is None  # B backlogged too
    assert _victim({"a": 1, "b": 3}, "b", _fair(a=16, b=1)) is None  # over its share: waits


def test_the_flooder_never_takes_a_borrowed_slot_back():
    # B borrowed: 3 held, A's answer ended (1 held) with its backlog still waiting.
    assert _victim({"a": 1, "b": 3}, "a", _fair(a=16)) is None
    # Not light, A reclaims only from a tenant more than one slot over its share.
    assert _victim({"a": 0, "b": 4}, "a", _fair(a=16)) == "b"
    # Light (its backlog gone), A under its share reclaims from B one over.
    assert _victim({"a": 1, "b": 3}, "a", _fair(a=1)) == "b"


def test_two_backlogged_tenants_one_slot_apart_wait_for_the_fair_order():
    assert _victim({"a": 3, "b": 1}, "b", _fair(a=16, b=8)) is None
    assert _victim({"a": 4}, "b", _fair(a=16, b=8)) == "a"  # two over: reclaimed


def test_at_most_half_the_slots_outstanding():
    assert max_outstanding(1) == 1 and max_outstanding(4) == 2 and max_outstanding(7) == 3
    assert _victim({"a": 4, "b": 1}, "b", _fair(b=1), inflight=5) == "a"  # one outstanding
    assert _victim({"a": 4, "b": 2}, "b", _fair(a=16, b=1), inflight=6) is None  # two: the cap
    assert _victim({"a": 4, "b": 1}, "b", _fair(b=1), inflight=3) is None  # a slot is free


def test_one_tenant_never_preempts():
    assert _victim({"a": 4}, "a", _fair(a=100)) is None
    assert _victim({"a": 4}, "a", _fair(a=1)) is None
