"""Placing a request whose prefix no engine holds by the engines' rows (issue 29), on both
backends: it goes to the engine with the most empty rows within the balance, else to the one
whose next row to evict has sat unused longest; it waits (a bounded time) for a full engine with
empty rows, or a much colder row, rather than evict a younger row where there is room; a grant
claims its row until a report newer than it, so a burst between two reports is not all sent to
one empty row; the Redis scripts and the in-process twin agree step by step; and an engine that
reports rows or idle times it cannot have is offered to nobody."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from slotserve.contracts.engine_load import MAX_ROW_IDLE_MS
from slotserve.contracts.pool_spec import MAX_PREFIX_CACHE_ROWS
from slotserve.contracts.prefix_keys import chat_chain
from slotserve.gateway.admission.front import Admission, Lease
from slotserve.gateway.admission.types import PoolPolicy
from slotserve.gateway.pools.engines import BadReportError, parse_load_report
from slotserve.gateway.pools.routing import (
    COLDER_BY_MS,
    ROW_CLAIM_MARGIN_MS,
    EndpointOffer,
    Route,
    claim_cutoff_us,
    offer_is_sound,
    pick_endpoint,
    rank_endpoints,
    waits_for_engine,
    with_claims,
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
    # No empty row and no idle row known anywhere: the least loaded, as before.
    bare = [EndpointOffer(url, 4, 0.0) for url in (A, B, C)]
    assert pick_endpoint(rank_endpoints(bare, inflight), inflight, route, {})[1:] == ("load", 0)


def test_with_no_empty_row_the_coldest_row_is_evicted_within_the_balance():
    offers = [EndpointOffer(url, 4, 0.0, row_idle_ms=idle) for url, idle in
              ((A, 500), (B, 9_000), (C, 60_000))]  # fmt: skip
    inflight = {A: 0, B: 1, C: 3}
    ranked = rank_endpoints(offers, inflight)
    route = first_turn("x")
    # C's row is the coldest but C is 0.75 above A: B's, the next coldest.
    assert pick_endpoint(ranked, inflight, route, {})[:2] == (offers[1], "rows")
    assert pick_endpoint(ranked, {A: 0, B: 1, C: 2}, route, {})[0].url == C
    # An empty row anywhere (within the balance) outranks any idle row.
    roomy = [*offers[:2], EndpointOffer(C, 4, 0.0, rows_free=1)]
    assert (
        pick_endpoint(rank_endpoints(roomy, inflight), {A: 0, B: 1, C: 2}, route, {})[0] == roomy[2]
    )


def test_a_claim_takes_an_empty_row_until_a_report_newer_than_it():
    offer = EndpointOffer(A, 4, 0.0, rows_free=2, report_age_ms=300)
    now = 10_000_000
    assert claim_cutoff_us(offer, now) == now - (300 + ROW_CLAIM_MARGIN_MS) * 1000
    assert with_claims(offer, 0) == offer
    assert (with_claims(offer, 1).rows_free, with_claims(offer, 1).row_idle_ms) == (1, 0)
    # Past the empty rows, which row goes next is not known until the engine reports it.
    cold = EndpointOffer(A, 4, 0.0, row_idle_ms=40_000)
    assert (with_claims(cold, 1).rows_free, with_claims(cold, 1).row_idle_ms) == (0, 0)


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


@pytest.mark.parametrize(
    ("idle_a", "idle_b", "waits"),
    [
        (9_000, 1_000, True),  # A's next row is much colder than the row B would give up
        (9_000, 9_000 - COLDER_BY_MS, False),  # rows a second apart are alike: go to B now
        (9_000, 9_000 - COLDER_BY_MS - 1, True),
        (9_000, 0, True),  # B's next row is not known (claimed since its report)
        (0, 0, False),
    ],
)
def test_the_rule_waits_for_a_much_colder_row_on_a_full_engine(idle_a, idle_b, waits):
    offers = [
        EndpointOffer(A, 4, 0.0, row_idle_ms=idle_a),
        EndpointOffer(B, 4, 0.0, row_idle_ms=idle_b),
    ]
    assert waits_for_engine(offers, {A: 4, B: 3}, first_turn("x"), {}, "", 1, offers[1]) == waits


def test_rows_no_engine_can_have_make_the_offer_unsound_and_the_report_broken():
    assert offer_is_sound(EndpointOffer(A, 4, 0.0, rows_free=MAX_PREFIX_CACHE_ROWS))
    assert offer_is_sound(EndpointOffer(A, 4, 0.0, row_idle_ms=MAX_ROW_IDLE_MS))
    for rows in (-1, MAX_PREFIX_CACHE_ROWS + 1, True):
        assert not offer_is_sound(EndpointOffer(A, 4, 0.0, rows_free=rows))
    for idle in (-1, MAX_ROW_IDLE_MS + 1, 1.5, False):
        assert not offer_is_sound(EndpointOffer(A, 4, 0.0, row_idle_ms=idle))  # type: ignore[arg-type]
    assert not offer_is_sound(EndpointOffer(A, 4, 0.0, report_age_ms=-1))
    for bad_idle in (-1, MAX_ROW_IDLE_MS + 1, "x"):
        with pytest.raises(BadReportError):
            parse_load_report(
                json.dumps({"slots_total": 4, "prefix_row_idle_ms": bad_idle}).encode()
            )
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


async def test_a_burst_between_two_reports_is_not_all_sent_to_one_empty_row(cluster):
    # A reports one empty row, B none but a cold row: the second first turn, before A reports
    # again, would evict A's least recently used row; B's cold one goes instead.
    cluster.serve(POOL, (A, 4, 0.0, 1), (B, 4, 0.0, 0, 30_000))
    replica = await cluster.replica()
    assert (await take(replica, first_turn("1"))).endpoint == A
    assert (await take(replica, first_turn("2"))).endpoint == B
    # A report read after the claims (these offers are read "now") shows them: A's row is back
    # in the count only as the engine reports it, so the next goes by the report again.
    await asyncio.sleep((ROW_CLAIM_MARGIN_MS + 100) / 1000)
    assert (await take(replica, first_turn("3"))).endpoint == A
    # A request whose prefix B holds claims no row there: B's cold row is still the one the next
    # new prefix takes (A's row is claimed by the third).
    held = first_turn("4")
    cluster.serve(POOL, (A, 4, 0.0, 1), (B, 4, 0.0, 0, 30_000))
    route = Route(keys=held.keys, depths=((B, 1),), wait_ms=5000, look_ahead=8)
    assert (await take(replica, route)).endpoint == B
    assert (await take(replica, first_turn("5"))).endpoint == B


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

    def offer(url: str, slots: int, load: float, rows: int, idle: int = 0, age: int = 0):
        return EndpointOffer(url, slots, load, rows_free=rows, row_idle_ms=idle, report_age_ms=age)

    offer_sets = [
        [offer(A, 2, 0.5, 0), offer(B, 2, 0.0, 4), offer(C, 3, 0.25, 4)],
        [offer(A, 2, 0.0, 9), offer(B, 2, 0.0, 0), offer(C, 3, 0.0, 1)],
        # An unsound one among them: both sides skip it.
        [offer(A, 2, 0.0, -4), offer(B, 2, 0.1, 2), offer(C, 3, 0.0, 0)],
        # No empty row: by the coldest row (reports of different ages: the claims since each).
        [offer(A, 2, 0.0, 0, 4_000, 1), offer(B, 2, 0.0, 0, 20_000, 3), offer(C, 3, 0.0, 1, 0, 2)],
        [
            offer(A, 2, 0.0, 0, 4_000),
            offer(B, 2, 0.0, 0, 900),
            offer(C, 3, 0.0, 0, MAX_ROW_IDLE_MS + 1),
        ],
    ]
    try:
        granted: list[str] = []
        for step in range(60):
            offers = offer_sets[(step // 6) % len(offer_sets)]
            route = first_turn(str(step), wait_ms=3 if step % 4 else 0)
            request_id = f"r{step}"
            await twin.run(
                step % 2, "enqueue", POOL, offers, request_id, 5, 30_000_000, route=route
            )
            granted += [rid for _, rid, _ in sorted(twin.memory_side.step_deliveries)]
            if len(granted) >= 6:  # about a grant a step: the oldest lease goes
                await twin.run(step % 2, "release", POOL, offers, granted.pop(0))
                granted += [rid for _, rid, _ in sorted(twin.memory_side.step_deliveries)]
            twin.advance(60_000)  # claims outlive a few steps (ROW_CLAIM_MARGIN_MS)
        assert twin.redis_side.delivered == twin.memory_side.delivered
        assert len(set(twin.redis_side.delivered.values())) == 3
        claims = twin.sync.keys(twin.keys.row_claims(POOL.name, "*"))
        assert sorted(claims) == sorted(twin.keys.row_claims(POOL.name, url) for url in (A, B, C))
    finally:
        await twin.close()
