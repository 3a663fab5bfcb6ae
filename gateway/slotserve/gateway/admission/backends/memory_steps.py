"""Who a dispatch step of the in-process backend may grant besides the head, and when a head
waits: a tenant's preemptor behind it (``lua/prelude.py``'s ``preemptor_behind``) and a request
waiting for the full engine that holds its prefix (``lua/routes.py``'s ``pick_routed``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from slotserve.gateway.admission.backends.memory_pool import Entry, PoolState
from slotserve.gateway.admission.preempt_share import PREEMPT_SCAN, Preemption, pick_preemption
from slotserve.gateway.admission.types import DEMOTION_OFFSET_US
from slotserve.gateway.pools.routing import EndpointOffer, Route, waits_for_engine


def preemption_for(
    state: PoolState, offers: Sequence[EndpointOffer], tenant: str, fields: Mapping[str, int]
) -> Preemption | None:
    """``pick_preemption`` over the pool's held counts and weights."""
    held, held_at = state.tenant_held, state.tenant_held_at
    return pick_preemption(offers, state.inflight, held, held_at, state.weights, tenant, fields)


def preemptor_behind(
    state: PoolState,
    offers: Sequence[EndpointOffer],
    head: Entry,
    now_us: int,
    alive: Callable[[str], bool],
) -> tuple[str, Entry, int, Preemption] | None:
    """The first of the head's level's first ``PREEMPT_SCAN`` entries in fair order whose
    tenant may preempt (each tenant judged by its first live one-slot entry there), with its
    tag and grant (``lua/prelude.py``'s ``preemptor_behind``)."""
    fair = state.fair.get(head.level)
    if fair is None:
        return None
    tried = {head.tenant}
    for request_id, tag in fair.first(PREEMPT_SCAN):
        entry = state.entries.get(request_id)
        if entry is None or entry.tenant in tried or entry.slots != 1 or entry.tenant is None:
            continue
        if tag >= DEMOTION_OFFSET_US or state.delays.get(request_id, now_us + 1) <= now_us:
            continue  # demoted, or due to be: it waits behind everyone
        if entry.deadline_us <= now_us or not alive(entry.replica):
            continue  # the head's sweep drops it in its turn
        tried.add(entry.tenant)
        preemption = preemption_for(state, offers, entry.tenant, fair.fields)
        if preemption is not None:
            return request_id, entry, tag, preemption
    return None


def cache_waits(
    state: PoolState,
    offers: Sequence[EndpointOffer],
    ranked: Sequence[EndpointOffer],
    entry: Entry | None,
    need: int,
    now_us: int,
    route: Route | None = None,
) -> bool:
    """Whether a request waits for the full engine holding its prefix (``lua/routes.py``'s
    ``pick_routed``): ``routing.waits_for_engine``, until an engine's room has gone unused for
    its route's ``wait_ms`` (``PoolState.room_idle_since_us``: while the requests behind take
    the room it passes up, its wait costs the pool nothing and goes on). ``entry`` None: the
    enqueue's fast path asks for ``route``, and a request that would wait queues instead."""
    route = entry.route if entry is not None else route
    if route is None or not route.may_wait:
        return False
    depths = state.routes.depths(route, now_us)
    session_url = state.routes.session_url(route, now_us)
    offers = state.routes.with_claims(offers, now_us)
    if not waits_for_engine(offers, state.inflight, route, depths, session_url, need, ranked[0]):
        return False
    if entry is None:
        return True
    since = state.room_idle_since_us
    return since is None or now_us - since < route.wait_ms * 1000
