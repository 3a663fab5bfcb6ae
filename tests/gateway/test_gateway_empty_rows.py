"""Placing a request whose prefix no engine holds by the engines' empty KV rows (issue 29), on
both backends: it goes to the engine with the most empty rows within the balance, it waits (a
bounded time) for a full engine with empty rows rather than evict a row where there is room
but no empty row, the Redis scripts and the in-process twin agree step by step, and an engine
that reports rows it cannot have is offered to nobody."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from slotserve.contracts.pool_spec import MAX_PREFIX_CACHE_ROWS
from slotserve.contracts.prefix_keys import chat_chain
from slotserve.gateway.admission.front import Admission, Lease
from slotserve.gateway.admission.types import PoolPolicy
from slotserve.gateway.pools.engines import BadReportError, parse_load_report
from slotserve.gateway.pools.routing import (
    EndpointOffer,
    Route,
    offer_is_sound,
    pick_endpoint,
    rank_endpoints,
    waits_for_engine,
)
from tests.gateway.admission_twin import Twin

A, B, C = "http://a", "http://b", "http://c"
POOL = PoolPolicy("m", max_queue_size=256, queue_timeout_s=10)


def first_turn(name: str, wait_ms: int = 5000, look_ahead: int = 8) -> Route:
    """A conversation's first turn: keys no engine holds, no session."""
    keys = chat_chain([{"role": "user", "content": f"new conversation {name}"}], "t").keys
    return Route(keys=keys, wait_ms=wait_ms, look_ahead=look_ahead)


async def take(replica: Admission, route: Route | None = None) -> Lease:
    return await asyncio.wait_for(replica.acquire(POOL, 5, 10.0, route=route), 10)


def test_the_rule_prefers_depth_then_session_then_empty_rows_then_load():
    offers = [EndpointOffer(A, 4, 0.0, rows_free=0), EndpointOffer(B, 4, 0.0, rows_free=3)]
    offers.append(EndpointOffer(C, 4, 0.0, rows_free=5))
    inflight = {A: 0, B: 1, C: 3}
    ranked = rank_endpoints(offers, inflight)
    route = first_turn("x")
    # C has the most empty rows but is 0.75 above A (balance 0.5): B, the next most.
    assert pick_endpoint(ranked, inflight, route, {}) == (offers[1], "rows", 0)
    assert pick_endpoint(ranked, {A: 0, B: 1, C: 2}, route, {})[0].url == C
    # A match or a session outranks empty rows; no route, no preference.
    assert pick_endpoint(ranked, inflight, route, {A: 1})[:2] == (offers[0], "prefix")
    assert pick_endpoint(ranked, inflight, route, {}, session_url=A)[1] == "session"
    assert pick_endpoint(ranked, inflight, None, {})[1] == "load"
    # No empty row anywhere: the least loaded, as before.
    bare = [EndpointOffer(url, 4, 0.0) for url in (A, B, C)]
    assert pick_endpoint(rank_endpoints(bare, inflight), inflight, route, {})[1:] == ("load", 0)


def test_the_rule_waits_for_empty_rows_only_where_the_engines_with_room_have_none():
    offers = [EndpointOffer(A, 4, 0.0, rows_free=2), EndpointOffer(B, 4, 0.0, rows_free=0)]
    route, least = first_turn("x"), offers[1]
    full_a = {A: 4, B: 3}
    assert waits_for_engine(offers, full_a, route, {}, "", 1, least)
    # B has an empty row too: go there now.
    roomy_b = [offers[0], EndpointOffer(B, 4, 0.0, rows_free=1)]
    assert not waits_for_engine(roomy_b, full_a, route, {}, "", 1, roomy_b[1])
    # A has room: no wait (the pick takes it).
    assert not waits_for_engine(offers, {A: 3, B: 3}, route, {}, "", 1, least)
    # A, once a slot frees (0.75), would be more than 0.5 above an idle B: go to B.
    assert not waits_for_engine(offers, {A: 4, B: 0}, route, {}, "", 1, least)
    # A session's engine is waited for instead; no empty row anywhere, nothing is.
    assert not waits_for_engine(offers, full_a, route, {}, B, 1, least)
    bare = [EndpointOffer(A, 4, 0.0), EndpointOffer(B, 4, 0.0)]
    assert not waits_for_engine(bare, full_a, route, {}, "", 1, bare[1])


def test_rows_no_engine_can_have_make_the_offer_unsound_and_the_report_broken():
    assert offer_is_sound(EndpointOffer(A, 4, 0.0, rows_free=MAX_PREFIX_CACHE_ROWS))
    for rows in (-1, MAX_PREFIX_CACHE_ROWS + 1, True):
        assert not offer_is_sound(EndpointOffer(A, 4, 0.0, rows_free=rows))
    good = {"slots_total": 4, "prefix_rows_free": 3}
    assert parse_load_report(json.dumps(good).encode()).prefix_rows_free == 3
    assert parse_load_report(b'{"slots_total": 4}').prefix_rows_free == 0  # an older engine
    for bad in (-1, MAX_PREFIX_CACHE_ROWS + 1, 1e300):
        with pytest.raises(BadReportError):
            parse_load_report(json.dumps({"slots_total": 4, "prefix_rows_free": bad}).encode())


async def test_a_first_turn_goes_where_it_evicts_nobody(cluster):
    cluster.serve(POOL, (A, 4, 0.0, 0), (B, 4, 0.0, 0), (C, 4, 0.0, 6))
    replica = await cluster.replica()
    assert (await take(replica, first_turn("1"))).endpoint == C
    assert (await take(replica, first_turn("2"))).endpoint == C  # 0.25 above A: within 0.5
    # C at 0.5 and A at 0: C is 0.5 above, still within; then at 0.75 it is not.
    assert (await take(replica, first_turn("3"))).endpoint == C
    assert (await take(replica, first_turn("4"))).endpoint == A  # least loaded, by load
    assert (await take(replica)).endpoint == B  # no route: by load only


async def test_a_first_turn_waits_for_a_full_engine_with_empty_rows_a_bounded_time(cluster):
    cluster.serve(POOL, (A, 1, 0.0, 3), (B, 1, 0.0, 0))
    replica = await cluster.replica()
    on_a = await take(replica, first_turn("1"))
    assert on_a.endpoint == A
    # A is full, B has room but no empty row: wait for A, and B goes to the one behind.
    waiting = asyncio.create_task(take(replica, first_turn("2", wait_ms=10_000)))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await replica.release(on_a)
    assert (await asyncio.wait_for(waiting, 5)).endpoint == A
    # Bounded: with A kept full it goes to B once its wait is over.
    start = time.monotonic()
    assert (await take(replica, first_turn("3", wait_ms=400))).endpoint == B
    assert 0.35 <= time.monotonic() - start < 3.0


async def test_the_scripts_place_by_empty_rows_as_the_in_process_twin(redis_server):
    twin = Twin(redis_server.url, "rows-twin", num_replicas=2, lease_ttl_s=30.0)
    await twin.start()
    offer_sets = [
        [EndpointOffer(A, 2, 0.5, 0), EndpointOffer(B, 2, 0.0, 4), EndpointOffer(C, 3, 0.25, 4)],
        [EndpointOffer(A, 2, 0.0, 9), EndpointOffer(B, 2, 0.0, 0), EndpointOffer(C, 3, 0.0, 1)],
        # An unsound one among them: both sides skip it.
        [EndpointOffer(A, 2, 0.0, -4), EndpointOffer(B, 2, 0.1, 2), EndpointOffer(C, 3, 0.0, 0)],
    ]
    try:
        issued: list[str] = []
        for step in range(48):
            offers = offer_sets[(step // 6) % len(offer_sets)]
            route = first_turn(str(step), wait_ms=3 if step % 4 else 0)
            request_id = f"r{step}"
            await twin.run(
                step % 2, "enqueue", POOL, offers, request_id, 5, 30_000_000, route=route
            )
            issued.append(request_id)
            if step % 3 == 2:
                await twin.run(step % 2, "release", POOL, offers, issued.pop(0))
            twin.advance(1000)
        assert twin.redis_side.delivered == twin.memory_side.delivered
        assert len(set(twin.redis_side.delivered.values())) == 3
    finally:
        await twin.close()
