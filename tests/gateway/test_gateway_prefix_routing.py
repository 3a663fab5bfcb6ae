"""Prefix-aware routing and session affinity in admission (issue 29), on both backends: a
request goes to the engine holding its prefix, a hot prefix spills past the balance threshold,
no engine ever holds more than its slots, a session stays while its engine has room, losing
Redis's data degrades to load routing; the Redis scripts and the in-process twin agree."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis

from slotserve.contracts.prefix_keys import chat_chain, deepest_match
from slotserve.gateway.admission.backends.redis import RedisBackend
from slotserve.gateway.admission.front import Admission, Lease
from slotserve.gateway.admission.lua.args import EnqueueArgs
from slotserve.gateway.admission.lua.replies import dispatch_grants
from slotserve.gateway.admission.types import InvalidAdmissionValueError, PoolPolicy
from slotserve.gateway.pools.routing import (
    EndpointOffer,
    Route,
    pick_endpoint,
    rank_endpoints,
    sendable_route,
)
from tests.gateway.admission_cluster import Cluster
from tests.gateway.admission_twin import Twin

A, B, C = "http://a", "http://b", "http://c"
POOL = PoolPolicy("m", max_queue_size=256, queue_timeout_s=10)
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
KEYS = chat_chain(HISTORY, "tenant").keys
SESSION = "ab" * 16


def serve(cluster: Cluster, slots: int = 4) -> None:
    cluster.serve(POOL, (A, slots, 0.0), (B, slots, 0.0), (C, slots, 0.0))


async def take(replica: Admission, route: Route | None = None) -> Lease:
    return await asyncio.wait_for(replica.acquire(POOL, 5, 10.0, route=route), 10)


def cached_on(url: str, depth: int = 2, balance: int = 500) -> Route:
    return Route(keys=KEYS, depths=((url, depth),), balance_permille=balance)


async def test_a_cached_prefix_goes_to_the_engine_holding_it(cluster):
    serve(cluster)
    replica = await cluster.replica()
    assert (await take(replica)).endpoint == A  # by load: the first of equals
    deepest = Route(keys=KEYS, depths=((B, 1), (C, 2)))
    lease = await take(replica, deepest)
    assert lease.endpoint == C  # the deepest match, though B and C hold as little as A's 1
    # Just routed: the next request of that prefix sticks to C before its /load shows it.
    assert (await take(replica, Route(keys=KEYS))).endpoint == C


async def test_a_hot_prefix_spills_past_the_balance_threshold(cluster):
    serve(cluster)
    replica = await cluster.replica()
    got = [(await take(replica, cached_on(C))).endpoint for _ in range(12)]
    # C takes the prefix while it is within half its slots of the least loaded (0.5), then the
    # others get it; every engine ends full, none above its slots.
    assert got[:3] == [C, C, C] and got[3] != C, got
    assert Counter(got) == {A: 4, B: 4, C: 4}


async def test_a_flood_of_one_prefix_from_two_replicas_never_overfills_an_engine(cluster):
    serve(cluster, slots=2)
    replicas = [await cluster.replica(), await cluster.replica()]
    held: Counter[str] = Counter()
    worst: Counter[str] = Counter()

    async def one(index: int) -> str:
        lease = await take(replicas[index % 2], cached_on(A, balance=1000))
        held[lease.endpoint] += 1
        worst[lease.endpoint] = max(worst[lease.endpoint], held[lease.endpoint])
        await asyncio.sleep(0.02)
        held[lease.endpoint] -= 1
        await replicas[index % 2].release(lease)
        return lease.endpoint

    served = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(60))), 60)
    assert max(worst.values()) <= 2, worst
    assert set(served) == {A, B, C}  # the flood spilled over: A's slots bound it


async def test_a_session_stays_while_its_engine_has_room_and_moves_when_full(cluster):
    cluster.serve(POOL, (A, 4, 0.0), (B, 4, 0.0), (C, 1, 0.0))
    replica, other = await cluster.replica(), await cluster.replica()
    session = Route(session=SESSION, balance_permille=1000)
    fill_a, fill_b = await take(replica), await take(replica)  # A and B: one each
    first = await take(replica, session)
    assert first.endpoint == C  # the least loaded
    await replica.release(first)
    # C is the session's engine: the next turn (another replica) goes there, not to A or B.
    again = await take(other, session)
    assert again.endpoint == C
    # C is full (1 slot): the session moves, and stays where it moved.
    moved = await take(other, session)
    assert moved.endpoint in (A, B)
    await replica.release(again)
    for lease in (fill_a, fill_b):
        await replica.release(lease)
    assert (await take(replica, session)).endpoint == moved.endpoint


async def test_sessions_and_routings_stay_within_the_balance(cluster):
    serve(cluster)
    replica = await cluster.replica()
    strict = Route(keys=KEYS, session=SESSION, balance_permille=0)
    first = await take(replica, strict)
    # Threshold 0: a preferred engine only while it is among the least loaded.
    assert (await take(replica, strict)).endpoint != first.endpoint
    assert first.endpoint == A


@pytest.mark.parametrize("cluster", ["redis"], indirect=True)
async def test_losing_redis_data_degrades_to_load_routing(cluster, redis_server):
    serve(cluster)
    replica = await cluster.replica()
    route = Route(keys=KEYS, session=SESSION)
    fills = [await take(replica), await take(replica)]  # A and B hold one each
    first = await take(replica, route)
    assert first.endpoint == C
    for lease in (*fills, first):
        await replica.release(lease)
    assert (await take(replica, route)).endpoint == C  # remembered (routed keys, session)
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    # The index is gone (and the epoch: admission waits for leases to come back): the request
    # is served, by load (A, the first of the least loaded), without an error.
    assert (await take(replica, route)).endpoint == A


def test_the_rule_in_python_prefers_depth_then_session_then_load():
    offers = [EndpointOffer(A, 4, 0.0), EndpointOffer(B, 4, 0.0), EndpointOffer(C, 2, 0.0)]
    inflight = {A: 1, B: 2, C: 1}
    ranked = rank_endpoints(offers, inflight)
    assert [o.url for o in ranked] == [A, B, C]
    route = Route(keys=KEYS, balance_permille=500)
    assert pick_endpoint(ranked, inflight, None, {}) == (ranked[0], "load", 0)
    assert pick_endpoint(ranked, inflight, route, {B: 1, C: 2})[1:] == ("prefix", 2)
    assert pick_endpoint(ranked, inflight, route, {B: 1, C: 2})[0].url == C  # 0.5-0.25 ok
    assert pick_endpoint(ranked, {**inflight, C: 2}, route, {C: 2})[0].url == A  # C is full
    tight = Route(keys=KEYS, balance_permille=200)
    assert pick_endpoint(ranked, inflight, tight, {C: 2})[0].url == A  # 0.25 > 0.2
    assert pick_endpoint(ranked, inflight, route, {}, session_url=B)[1] == "session"


def test_a_tenant_never_matches_another_tenants_index():
    held = set(chat_chain(HISTORY, "tenant-a").keys)
    assert deepest_match(chat_chain(HISTORY, "tenant-a").keys, held) == 2
    assert deepest_match(chat_chain(HISTORY, "tenant-b").keys, held) == 0


# -- both backends step by step ----------------------------------------------------------------


async def test_the_scripts_route_as_the_in_process_twin(redis_server):
    twin = Twin(redis_server.url, "twin", num_replicas=2, lease_ttl_s=30.0)
    await twin.start()
    offers = [EndpointOffer(A, 3, 0.5), EndpointOffer(B, 3, 0.0), EndpointOffer(C, 2, 0.25)]
    routes = [
        None,
        Route(keys=KEYS, depths=((C, 2),)),
        Route(keys=KEYS[:1]),
        Route(keys=KEYS, depths=((A, 1), (B, 1)), session=SESSION, balance_permille=1000),
        Route(session=SESSION, balance_permille=0),
        Route(keys=chat_chain(HISTORY, "other").keys, depths=(("http://gone", 2),)),
        Route(keys=("Z" * 16, *KEYS), depths=((f"{A}\x1fx", 3), (C, 99), (B, 1))),
        Route(keys=KEYS, session="not-hex"),
    ]
    try:
        issued: list[str] = []
        for step in range(40):
            route = routes[step % len(routes)]
            request_id = f"r{step}"
            await twin.run(
                step % 2, "enqueue", POOL, offers, request_id, 5, 30_000_000, route=route
            )
            issued.append(request_id)
            if step % 3 == 2:  # free the oldest lease: queued requests are granted by release
                done = issued.pop(0)
                await twin.run(step % 2, "release", POOL, offers, done)
            twin.advance(1000)
        assert twin.redis_side.delivered == twin.memory_side.delivered
        assert len(set(twin.redis_side.delivered.values())) == 3  # every engine was chosen
    finally:
        await twin.close()


def test_a_route_is_cleaned_as_the_scripts_read_it():
    hostile = Route(
        keys=("Z" * 16, *KEYS, "short"),
        depths=((f"{A}\x1fx", 3), (C, 99), (B, 2)),
        session=SESSION,
    )
    clean = sendable_route(hostile)
    assert clean is not None
    assert clean.keys == KEYS and clean.depths == ((B, 2),)
    assert sendable_route(Route(session="not-hex")) is None
    assert sendable_route(Route(balance_permille=1001)) is None
    assert sendable_route(Route(depths=(("http://" + "x" * 20_000, 1),))) is None


def raw_enqueue(request_id: str, route: str) -> EnqueueArgs:
    return EnqueueArgs(
        request_id=request_id,
        priority=5,
        timeout_us=1_000_000,
        max_queue_size=8,
        only_if_absent=False,
        drain_gap_us=1000,
        queue_timeout_us=1_000_000,
        aging_us=0,
        level_max_queue_size=8,
        demote_after_us=0,
        slots=1,
        tenant="default",
        weight=1,
        deadline_gap_us=0,
        route=route,
    )


async def test_route_text_that_does_not_read_routes_by_load(redis_server):
    """Raw script calls (another gateway version, a hand edit): a route that does not read is
    no route, one past the bound is refused whole; never an error, never a full engine."""
    backend = RedisBackend(redis_server.url, "raw", prefix="raw", lease_ttl_s=1.0)
    await backend.start(lambda pool, request_id, endpoint: None)  # past the new epoch's grace
    offers = [EndpointOffer(A, 1, 0.0), EndpointOffer(B, 1, 0.0)]
    try:
        garbage = ["\x1e\x1e\x1e", "x\x1e\x1e\x1e", f"500\x1e\x1e{B}\x1fnan\x1e", "\x1f" * 50]
        for index, text in enumerate([*garbage, f"500\x1e\x1e{B}\x1f1\x1e{KEYS[0]}"]):
            args = raw_enqueue(f"g{index}", text)
            reply = await backend._dispatch("enqueue", POOL, offers, args)
            assert reply[0] == "ok", (text, reply)
            grants = dispatch_grants(reply)
            assert grants[0][1] == (B if index == len(garbage) else A), (text, grants)
            await backend.release(POOL, offers, f"g{index}")
        with pytest.raises(InvalidAdmissionValueError, match="route"):
            await backend._dispatch("enqueue", POOL, offers, raw_enqueue("big", "5" * 20_000))
    finally:
        await backend.close()
