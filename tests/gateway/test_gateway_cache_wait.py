"""Waiting for the engine that holds a request's prefix (issue 29), on both backends: a head
whose engine is full waits for it, a bounded time, while requests behind it (its priority level,
a bounded window, in fair order) are dispatched past it; no engine over its slots; the Redis
scripts and the in-process twin agree step by step, their whole state compared."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from slotserve.contracts.pool_spec import RoutingSpec
from slotserve.contracts.prefix_keys import chat_chain
from slotserve.gateway.admission.backends import memory_routes
from slotserve.gateway.admission.backends.redis import RedisBackend
from slotserve.gateway.admission.front import Admission, Lease
from slotserve.gateway.admission.lua.replies import dispatch_grants
from slotserve.gateway.admission.preempt_share import split_grant
from slotserve.gateway.admission.types import PoolPolicy
from slotserve.gateway.http.route_hints import route_of
from slotserve.gateway.pools.config import Pool, PoolRegistry
from slotserve.gateway.pools.engines import EngineLoad, EngineMonitor
from slotserve.gateway.pools.routing import (
    COLD_CACHE_WAIT_MS,
    MAX_CACHE_WAIT_MS,
    MAX_LOOK_AHEAD,
    EndpointOffer,
    Route,
    cache_wait_ms,
    sendable_route,
    waits_for_engine,
)
from tests.gateway.admission_twin import Twin
from tests.gateway.gateway_support import pool, write_pools
from tests.gateway.test_gateway_prefix_routing import raw_enqueue
from tests.gateway.test_gateway_prefix_routing_http import chat, polled

A, B, C = "http://a", "http://b", "http://c"
POOL = PoolPolicy("m", max_queue_size=256, queue_timeout_s=10)
# Without preemption for a tenant under its share, which would let a new tenant in at once.
NO_PREEMPT = PoolPolicy("m", max_queue_size=256, queue_timeout_s=10, preempt_for_share=False)


def history(name: str) -> tuple[str, ...]:
    messages = [{"role": "user", "content": f"conversation {name}"}]
    return chat_chain(messages, "tenant").keys


def held_on(url: str, name: str = "x", wait_ms: int = 5000, look_ahead: int = 8) -> Route:
    """A later turn whose history the engine at ``url`` holds."""
    keys = history(name)
    return Route(keys=keys, depths=((url, len(keys)),), wait_ms=wait_ms, look_ahead=look_ahead)


async def take(replica: Admission, route: Route | None = None, priority: int = 5) -> Lease:
    return await asyncio.wait_for(replica.acquire(POOL, priority, 10.0, route=route), 10)


async def settle() -> None:
    """Long enough for a few ticks (50-100 ms) on either backend."""
    await asyncio.sleep(0.3)


async def test_a_head_waits_for_its_engine_while_one_behind_it_passes(cluster):
    cluster.serve(POOL, (A, 1, 0.0), (B, 1, 0.0))
    replica = await cluster.replica()
    on_a, on_b = await take(replica), await take(replica)
    assert (on_a.endpoint, on_b.endpoint) == (A, B)
    head = asyncio.create_task(take(replica, held_on(A)))
    await settle()
    behind = asyncio.create_task(take(replica))  # a first turn: no engine preferred
    await settle()
    await replica.release(on_b)  # B frees: the head waits for A, the one behind passes
    passed = await asyncio.wait_for(behind, 5)
    assert passed.endpoint == B
    assert not head.done()
    await replica.release(on_a)
    assert (await asyncio.wait_for(head, 5)).endpoint == A  # its engine, its history


async def test_the_wait_is_bounded(cluster):
    cluster.serve(POOL, (A, 1, 0.0), (B, 1, 0.0))
    replica = await cluster.replica()
    await take(replica)  # A stays full
    start = time.monotonic()
    lease = await take(replica, held_on(A, wait_ms=400))
    waited = time.monotonic() - start
    assert lease.endpoint == B  # given up on A: where there is room
    assert 0.35 <= waited < 3.0, waited


async def test_the_wait_runs_only_while_the_room_it_passes_up_goes_unused(cluster):
    # A saturated pool: the head waits for A while those behind it take every slot B frees.
    # Its wait (300 ms) is long past, but no slot went unused for it: it still waits, and
    # gets its own engine once A frees. Only room left idle counts against a wait.
    cluster.serve(POOL, (A, 1, 0.0), (B, 1, 0.0))
    replica = await cluster.replica()
    on_a, on_b = await take(replica), await take(replica)
    head = asyncio.create_task(take(replica, held_on(A, wait_ms=300)))
    await settle()
    for round_ in range(3):
        behind = asyncio.create_task(take(replica))  # a first turn
        await settle()
        await replica.release(on_b)
        on_b = await asyncio.wait_for(behind, 5)
        assert on_b.endpoint == B, round_
        await asyncio.sleep(0.3)  # more than the head's wait, with B full again
        assert not head.done(), round_
    await replica.release(on_a)
    assert (await asyncio.wait_for(head, 5)).endpoint == A
    # Room that nobody takes counts: with A held again, B's free slot goes to the head once
    # it has sat unused for the head's wait.
    again = asyncio.create_task(take(replica, held_on(A, "y", wait_ms=300)))
    await settle()
    start = time.monotonic()
    await replica.release(on_b)
    assert (await asyncio.wait_for(again, 5)).endpoint == B
    assert 0.2 <= time.monotonic() - start < 3.0


async def test_a_wait_of_zero_routes_among_the_engines_with_room_as_before(cluster):
    cluster.serve(POOL, (A, 1, 0.0), (B, 1, 0.0))
    replica = await cluster.replica()
    await take(replica)
    start = time.monotonic()
    assert (await take(replica, held_on(A, wait_ms=0))).endpoint == B
    assert time.monotonic() - start < 0.3


async def test_nobody_passes_beyond_the_window_nor_from_another_level(cluster):
    cluster.serve(POOL, (A, 1, 0.0), (B, 1, 0.0))
    replica = await cluster.replica()
    on_a, on_b = await take(replica), await take(replica)
    head = asyncio.create_task(take(replica, held_on(A, "h", look_ahead=1)))
    await settle()
    also_a = asyncio.create_task(take(replica, held_on(A, "y")))  # waits for A too
    await settle()
    beyond = asyncio.create_task(take(replica))  # third in line: outside a window of 1
    await settle()
    other_level = asyncio.create_task(take(replica, priority=6))
    await settle()
    await replica.release(on_b)
    await settle()
    assert not any(t.done() for t in (head, also_a, beyond, other_level))
    await replica.release(on_a)  # A frees: the head takes it, then B goes by the window
    assert (await asyncio.wait_for(head, 5)).endpoint == A
    assert (await asyncio.wait_for(beyond, 5)).endpoint == B
    assert not also_a.done() and not other_level.done()


async def test_requests_pass_a_waiting_head_in_their_tenants_fair_order(cluster):
    cluster.serve(NO_PREEMPT, (A, 1, 0.0), (B, 1, 0.0))
    replica = await cluster.replica()
    order: list[str] = []

    async def one(name: str, tenant: str, route: Route | None = None) -> Lease:
        lease = await asyncio.wait_for(
            replica.acquire(NO_PREEMPT, 5, 10.0, tenant=tenant, route=route), 10
        )
        order.append(name)
        return lease

    on_a, on_b = await one("fill", "default"), await one("fill", "default")
    order.clear()
    head = asyncio.create_task(one("head", "flood", held_on(A)))
    await settle()
    floods = [asyncio.create_task(one(f"flood{i}", "flood")) for i in range(3)]
    await settle()
    other = asyncio.create_task(one("other", "quiet"))  # last to arrive, first in fair order
    await settle()
    await replica.release(on_b)  # B frees while the head waits for A: "quiet" passes first
    passed = await asyncio.wait_for(other, 5)
    assert order == ["other"] and passed.endpoint == B
    await replica.release(passed)
    await asyncio.wait_for(floods[0], 5)  # then the flood, in its own order
    assert order == ["other", "flood0"] and not head.done()
    await replica.release(on_a)
    assert (await asyncio.wait_for(head, 5)).endpoint == A


async def test_requests_behind_go_to_their_own_engines_and_none_is_overfilled(cluster):
    cluster.serve(POOL, (A, 2, 0.0), (B, 2, 0.0), (C, 2, 0.0))
    replicas = [await cluster.replica(), await cluster.replica()]
    held: dict[str, int] = {A: 0, B: 0, C: 0}
    worst = dict(held)
    served: list[tuple[str, str]] = []

    async def one(index: int) -> None:
        url = (A, B, C)[index % 3] if index % 4 else A  # a hot engine, and the others'
        lease = await take(replicas[index % 2], held_on(url, str(index), wait_ms=2000))
        held[lease.endpoint] += 1
        worst[lease.endpoint] = max(worst[lease.endpoint], held[lease.endpoint])
        served.append((url, lease.endpoint))
        await asyncio.sleep(0.03)
        held[lease.endpoint] -= 1
        await replicas[index % 2].release(lease)

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(48))), 60)
    assert max(worst.values()) <= 2, worst
    hits = sum(1 for wanted, got in served if wanted == got)
    assert hits >= 40, served  # nearly every request found its engine


def test_the_rule_waits_only_for_a_full_engine_within_the_balance():
    offers = [EndpointOffer(A, 4, 0.0), EndpointOffer(B, 4, 0.0), EndpointOffer(C, 4, 0.0)]
    route = held_on(A)
    least = offers[1]
    full_a = {A: 4, B: 3, C: 4}
    assert waits_for_engine(offers, full_a, route, {A: 2}, "", 1, least)
    assert not waits_for_engine(offers, {A: 3, B: 3}, route, {A: 2}, "", 1, least)  # room at A
    # B idles: A, once a slot frees (0.75), is more than 0.5 above B (0): go to B now.
    assert not waits_for_engine(offers, {A: 4}, route, {A: 2}, "", 1, least)
    # The deepest match counts: B holds it too and has room.
    assert not waits_for_engine(offers, full_a, route, {A: 2, B: 2}, "", 1, least)
    assert waits_for_engine(offers, full_a, route, {A: 2, B: 1}, "", 1, least)
    # No match: the session's engine, full, is waited for; none, nothing is.
    assert waits_for_engine(offers, full_a, route, {}, C, 1, least)
    assert not waits_for_engine(offers, full_a, route, {}, "", 1, least)
    assert not waits_for_engine(offers, full_a, route, {"http://gone": 3}, "", 1, least)


def test_the_pool_settings_reach_the_route_and_are_bounded():
    spec = RoutingSpec.model_validate({"cacheWaitMilliseconds": 1500, "lookAhead": 4})
    assert (spec.cache_wait_milliseconds, spec.look_ahead) == (1500, 4)
    defaults = RoutingSpec()
    assert (defaults.cache_wait_milliseconds, defaults.cache_wait_turnovers) == (20_000, 3.0)
    assert defaults.look_ahead == 8
    assert RoutingSpec.model_validate({"cacheWaitTurnovers": 1.5}).cache_wait_turnovers == 1.5
    for bad in (-1, 33, "many"):
        with pytest.raises(ValueError):
            RoutingSpec.model_validate({"cacheWaitTurnovers": bad})
    fields = RoutingSpec.model_fields
    assert fields["cache_wait_milliseconds"].metadata[-1].le == MAX_CACHE_WAIT_MS
    assert fields["look_ahead"].metadata[-1].le == MAX_LOOK_AHEAD
    assert sendable_route(Route(wait_ms=MAX_CACHE_WAIT_MS + 1)) is None
    assert sendable_route(Route(look_ahead=MAX_LOOK_AHEAD + 1)) is None
    assert sendable_route(held_on(A)) == held_on(A)


async def test_a_wait_that_does_not_read_routes_by_load(redis_server):
    """Raw script calls: a route of an older gateway (four fields) never waits; a wait or
    look-ahead out of bounds is no route; never an error."""
    backend = RedisBackend(redis_server.url, "raw", prefix="rawwait", lease_ttl_s=1.0)
    await backend.start(lambda pool, request_id, endpoint: None)
    offers = [EndpointOffer(A, 1, 0.0), EndpointOffer(B, 1, 0.0)]
    key = history("x")[0]
    try:
        full = await backend._dispatch("enqueue", POOL, offers, raw_enqueue("fill", ""))
        assert dispatch_grants(full)[0][1] == A
        texts = [
            f"500\x1e\x1e{A}\x1f1\x1e{key}",
            f"500\x1e\x1e{A}\x1f1\x1e{key}\x1e99999999\x1e8",
            f"500\x1e\x1e{A}\x1f1\x1e{key}\x1e2000\x1e33",
            f"500\x1e\x1e{A}\x1f1\x1e{key}\x1e-1\x1e8",
        ]
        for index, text in enumerate(texts):
            reply = await backend._dispatch("enqueue", POOL, offers, raw_enqueue(f"w{index}", text))
            assert reply[0] == "ok", (text, reply)
            assert dispatch_grants(reply)[0][1] == B, (text, reply)
            await backend.release(POOL, offers, f"w{index}")
        # (a key of its own: the ones above were routed to B lately, which counts as B's match)
        fresh = history("z")[0]
        waits = f"500\x1e\x1e{A}\x1f1\x1e{fresh}\x1e2000\x1e8"
        reply = await backend._dispatch("enqueue", POOL, offers, raw_enqueue("waits", waits))
        assert reply[0] == "ok" and dispatch_grants(reply) == [], reply  # queued for A
    finally:
        await backend.close()


# -- both backends step by step ----------------------------------------------------------------


async def test_the_scripts_wait_and_pass_as_the_in_process_twin(redis_server, monkeypatch):
    # Routed keys outlive the run on both sides (Redis's TTL runs on the real clock, the hub's
    # on the fake one; a slow run diverged at a key Redis had dropped after 5 real seconds).
    monkeypatch.setattr(memory_routes, "ROUTED_TTL_MS", 3_600_000)
    twin = Twin(
        redis_server.url, "cwtwin", num_replicas=2, lease_ttl_s=30.0, routed_ttl_ms=3_600_000
    )
    await twin.start()
    offers = [EndpointOffer(A, 2, 0.0), EndpointOffer(B, 2, 0.1), EndpointOffer(C, 1, 0.2)]
    rng = random.Random(29)
    names = [str(i) for i in range(6)]
    try:
        issued: list[str] = []
        num_waiting = 0  # the most requests waiting for their engines at once
        for step in range(400):
            inflight = twin.redis_state(POOL)["inflight"]
            assert isinstance(inflight, dict)
            before = dict(inflight)
            roll = rng.random()
            who = rng.randrange(2)
            if roll < 0.5:
                request_id = f"r{step}"
                url, name = rng.choice([A, B, C]), rng.choice(names)
                route = rng.choice(
                    [
                        None,
                        held_on(url, name, wait_ms=rng.choice([0, 1, 50, 200])),
                        held_on(url, name, wait_ms=20, look_ahead=rng.choice([1, 2, 8])),
                        Route(keys=history(name), wait_ms=20, look_ahead=4),
                        Route(session="ab" * 16, wait_ms=20, look_ahead=4),
                    ]
                )
                priority = rng.choice([5, 5, 5, 6])
                tenant = rng.choice(["t1", "t2"])
                await twin.run(
                    who,
                    "enqueue",
                    POOL,
                    offers,
                    request_id,
                    priority,
                    rng.choice([30_000, 5_000_000, 5_000_000]),
                    route=route,
                    tenant=tenant,
                )
                issued.append(request_id)
            elif roll < 0.72 and (held := [r for r in issued if r in twin.redis_side.delivered]):
                done = rng.choice(held)
                issued.remove(done)
                await twin.run(who, "release", POOL, offers, done)
            elif roll < 0.76 and issued:
                await twin.run(who, "cancel", POOL, rng.choice(issued))
            else:
                await twin.run(who, "tick", POOL, offers)
            twin.check(POOL, offers, before)
            route_waits = twin.redis_state(POOL)["route_waits"]
            assert isinstance(route_waits, dict)
            num_waiting += len(route_waits)  # steps that left room unused for a waiting head
            twin.advance(rng.choice([100, 1000, 5000, 20_000]))
        delivered = twin.redis_side.delivered
        assert delivered == twin.memory_side.delivered
        assert {split_grant(grant)[0] for grant in delivered.values()} == {A, B, C}
        assert num_waiting >= 3
    finally:
        await twin.close()


# -- over HTTP: a gateway on Redis, engine doubles -----------------------------------------------


async def test_over_http_a_turn_waits_for_its_engine_and_a_first_turn_passes(
    spawn, redis_server, tmp_path
):
    doubles = [spawn.double(slots=1, delay=0.8) for _ in range(2)]
    spec = pool("double", [d.url for d in doubles])
    spec["routing"] = {"cacheWaitMilliseconds": 5000, "sessionHeader": ""}
    gateway = spawn.gateway(write_pools(tmp_path / "pools.yaml", [spec]), redis_server.url)
    messages = [{"role": "user", "content": "Hi there"}]
    doubles[0].control(prefix_keys=list(chat_chain(messages, "default").keys))
    polled(doubles[0], times=3)
    finished: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:

        async def send(name: str, content: str) -> int:
            status, _ = await chat(client, gateway.url, [{"role": "user", "content": content}])
            finished[name] = time.monotonic()
            return status

        first = asyncio.create_task(send("first", "Hi there"))  # to the engine holding it
        await asyncio.sleep(0.3)
        again = asyncio.create_task(send("again", "Hi there"))  # that engine is full: waits
        await asyncio.sleep(0.2)
        other = asyncio.create_task(send("other", "Something else"))  # passes, to the idle one
        assert await asyncio.gather(first, again, other) == [200, 200, 200]
    assert doubles[0].stats()["num_requests"] == 2
    assert doubles[1].stats()["num_requests"] == 1
    assert finished["other"] < finished["again"]


def test_the_wait_is_turnovers_of_the_engine_holding_the_prefix_within_the_cap():
    # A frees a slot every 12 s / 4 slots = 3 s, B every 1 s, C has finished nothing yet.
    offers = [
        EndpointOffer(A, 4, 0.0, 12.0),
        EndpointOffer(B, 2, 0.0, 2.0),
        EndpointOffer(C, 4, 0.0),
    ]
    assert cache_wait_ms(20_000, 3.0, offers, {A: 3, B: 1}) == 9_000  # A holds the deepest
    assert cache_wait_ms(20_000, 3.0, offers, {A: 2, B: 2}) == 6_000  # both: their mean gap, 2 s
    assert cache_wait_ms(20_000, 0.5, offers, {B: 1}) == 500
    assert cache_wait_ms(5_000, 3.0, offers, {A: 3}) == 5_000  # the cap holds
    # No match (a session's engine, known only to Redis): the pool's engines that measured.
    assert cache_wait_ms(20_000, 3.0, offers, {}) == 6_000
    # Nothing measured yet, a cold pool: the fixed wait, within the cap.
    assert cache_wait_ms(20_000, 3.0, offers, {C: 2}) == COLD_CACHE_WAIT_MS
    assert cache_wait_ms(1_000, 3.0, offers, {C: 2}) == 1_000
    # 0 turnovers: always the cap; a cap of 0 never waits, whatever the engines say.
    assert cache_wait_ms(7_000, 0.0, offers, {A: 3}) == 7_000
    assert cache_wait_ms(0, 3.0, offers, {A: 3}) == 0
    # Engines are untrusted: an offer that is not sound, or a mean that is not finite, is not
    # a measurement; a tiny gap still waits at least a millisecond.
    bad = [EndpointOffer(A, 0, 0.0, 5.0), EndpointOffer(B, 4, 0.0, float("inf"))]
    assert cache_wait_ms(20_000, 3.0, bad, {A: 3, B: 3}) == COLD_CACHE_WAIT_MS
    assert cache_wait_ms(20_000, 3.0, [EndpointOffer(A, 4, 0.0, 1e-9)], {A: 1}) == 1
    assert cache_wait_ms(20_000, 32.0, [EndpointOffer(A, 1, 0.0, 1e9)], {A: 1}) == 20_000


def test_a_request_routed_by_the_gateway_carries_its_engines_turnover_as_its_wait():
    registry = PoolRegistry([Pool("m", (A, B))])
    monitor = EngineMonitor(registry)
    first = [{"role": "user", "content": "tell me about slots"}]
    keys = chat_chain(first, "").keys
    monitor.loads[A] = EngineLoad(A, 4, 4, 0, num_failures=0, mean_request_s=8.0)
    monitor.loads[A].prefix_keys = frozenset(keys)
    monitor.loads[B] = EngineLoad(B, 4, 1, 0, num_failures=0, mean_request_s=1.0)
    later = {"messages": [*first, {"role": "assistant", "content": "they free"}]}
    spec = RoutingSpec()
    route = route_of(spec, monitor, "m", True, {}, later, "")
    assert route is not None and route.depths == ((A, len(keys)),)
    assert route.wait_ms == 6_000  # 3 turnovers of A's: 8 s / 4 slots
    capped = spec.model_copy(update={"cache_wait_milliseconds": 2_500})
    assert route_of(capped, monitor, "m", True, {}, later, "").wait_ms == 2_500  # type: ignore[union-attr]
    off = spec.model_copy(update={"prefix_aware": False})
    assert route_of(off, monitor, "m", True, {"x-session-id": "s"}, later, "").wait_ms == 0  # type: ignore[union-attr]
