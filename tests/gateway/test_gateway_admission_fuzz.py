"""Property-based fuzz of the admission scripts: no sequence of steps, values or faults poisons a
pool, on a real Redis, with the in-process backend as the oracle (``admission_twin.py``).

Each example is a random sequence of enqueues (priorities 0-9, n of 1-5, timeouts from 1 us to a
minute, DELAY demotion, aging, tenants of weights 1 to 1000), re-enqueues of known requests
(``only_if_absent``, as a restore does), cancels, releases, ticks, changes of the engines offered
(sound and not: 0 or 5,000 slots, NaN or infinite load), time passing (deadlines, lease expiry,
demotion, promises), replica death and heartbeats, hostile values through the backends' API, and raw
script calls with values no caller should send. After every step: both backends answered alike and
delivered the same grants (so both dispatch in the same order, tenants' fair shares included), no
engine holds more than its slots, the counts equal the entries, every lease was delivered once, and
the whole Redis state equals the oracle's (the fair tags and virtual times too); a raw call the
script refuses wrote nothing.
"""

from __future__ import annotations

import asyncio
import math
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.contracts.redis_keys import DispatchArgs
from slotserve.gateway.admission.types import InvalidAdmissionValueError, LevelPolicy, PoolPolicy
from slotserve.gateway.pools.routing import EndpointOffer
from tests.gateway.admission_twin import Twin
from tests.support import RedisServer

NUM_REPLICAS = 3
LEASE_TTL_S = 2.0
URLS = ("http://a", "http://b", "http://c")

replica = st.integers(0, NUM_REPLICAS - 1)
pick = st.integers(0, 1_000)  # an index into the requests issued so far (modulo their number)
enqueue = st.tuples(
    st.just("enqueue"),
    replica,
    st.sampled_from([0, 1, 2, 5, 9]),  # priority (0: a retry)
    st.sampled_from([1, 1, 1, 2, 3, 4, 5]),  # slots (n)
    st.sampled_from([1, 400_000, 1_500_000, 60_000_000]),  # timeout (us)
    st.sampled_from([None, 1, 500_000]),  # demote after (us)
    st.sampled_from([0, 300_000, 10_000_000]),  # aging (us)
    st.sampled_from([1, 250_000, 1_000_000, 1_500_000]),  # drain gap (us)
    st.sampled_from(["default", "a", "b.2"]),  # tenant
    st.sampled_from([1, 1, 2, 3, 1000]),  # its weight
    st.sampled_from([0, 0, 1, 150_000, 1_000_000]),  # deadline gap (us; 0: no refusal)
)
offer = st.tuples(
    st.sampled_from([1, 2, 3, 4, 4, 4, 0, 5_000]), st.sampled_from([0.0, 0.25, 1.0, math.nan])
)
# Each kind of step, as often as it appears here (enqueues and releases most).
STEPS = [
    *[enqueue] * 8,
    st.tuples(st.just("requeue"), replica, pick, st.sampled_from([1, 2, 4])),
    *[st.tuples(st.just("release"), replica, pick)] * 4,
    *[st.tuples(st.just("cancel"), replica, pick)] * 2,
    *[st.tuples(st.just("tick"), replica)] * 3,
    st.tuples(st.just("offers"), st.lists(offer, max_size=3)),
    *[st.tuples(st.just("advance"), st.sampled_from([1, 300_000, 1_000_000, 2_500_000]))] * 2,
    st.tuples(st.just("kill"), replica),
    st.tuples(st.just("heartbeat"), replica),
    st.tuples(st.just("hostile"), replica, st.integers(0, 15)),
    st.tuples(st.just("raw"), replica, st.integers(0, 14)),
]
step = st.sampled_from(STEPS).flatmap(lambda kind: kind)
pools = st.builds(
    lambda size, timeout_s, level, preempt: PoolPolicy(
        "m",
        max_queue_size=size,
        queue_timeout_s=timeout_s,
        priority_queue_policy=level,
        preempt_for_share=preempt,
    ),
    st.sampled_from([8, 3, 1, 2, 0]),
    st.sampled_from([1.0, 60.0]),
    st.sampled_from([(), ((2, LevelPolicy(1, 60.0)),), ((5, LevelPolicy(2, 1.0, "DELAY")),)]),
    st.booleans(),  # tenant preemption (``preempt_share.py``)
)

# Values no caller passes (``check_enqueue``): each must be refused alike by both backends.
HOSTILE = [
    {"slots": 10**14},
    {"slots": 0},
    {"slots": 1025},
    {"slots": True},
    {"priority": 10},
    {"priority": -1},
    {"timeout_us": 0},
    {"timeout_us": 10**20},
    {"drain_gap_us": 0},
    {"demote_after_us": 10**20},
    {"tenant": ""},
    {"tenant": "t" * 64},
    {"tenant": "a|b"},
    {"weight": 0},
    {"weight": 1001},
    {"deadline_gap_us": -1},
]
# Raw ARGV a script must refuse before its first write: (index after the shared ones, text).
RAW_ENQUEUE = [
    (10, "1e+14"),  # slots, as Lua's %.14g would write 10**14
    (10, "100000000000000"),
    (10, "nan"),
    (1, "0x5"),  # priority
    (1, " 5"),
    (2, "-1"),  # timeout
    (5, "inf"),  # drain gap
    (0, "a\x1fb"),  # request id with the grant separator
    (4, "2"),  # only-if-absent flag
    (7, "1e3"),  # aging
    (13, "-1"),  # deadline gap
    (11, "-a"),  # tenant
    (11, "a\x1fb"),
    (12, "0"),  # weight
    (12, "1001"),
]


def _offers(raw: list[tuple[int, float]]) -> list[EndpointOffer]:
    return [EndpointOffer(URLS[i], slots, load) for i, (slots, load) in enumerate(raw)]


async def run_example(url: str, pool: PoolPolicy, initial: list, steps: list) -> int:
    """Run ``steps`` on both backends, checking after each; the preempting grants made."""
    twin = Twin(url, f"f{uuid.uuid4().hex[:6]}", NUM_REPLICAS, LEASE_TTL_S)
    await twin.start()
    offers = _offers(initial)
    issued: list[str] = []
    try:
        for number, op in enumerate(steps):
            before = dict(twin.redis_state(pool)["inflight"])  # type: ignore[call-overload]
            kind = op[0]
            if kind == "enqueue":
                _, who, priority, slots, timeout_us, demote_us, aging_us, gap_us, tenant, w, dl = op
                request_id = f"r{number:04d}"
                issued.append(request_id)
                await twin.run(
                    who,
                    "enqueue",
                    pool,
                    offers,
                    request_id,
                    priority,
                    timeout_us,
                    drain_gap_us=gap_us,
                    aging_us=aging_us,
                    demote_after_us=demote_us,
                    slots=slots,
                    tenant=tenant,
                    weight=w,
                    deadline_gap_us=dl,
                )
            elif kind == "requeue" and (waiting := waiters(twin, issued)):
                # A waiter whose entry may be gone, put back as a restore does (only if absent).
                _, who, k, slots = op
                await twin.run(
                    who,
                    "enqueue",
                    pool,
                    offers,
                    waiting[k % len(waiting)],
                    5,
                    60_000_000,
                    only_if_absent=True,
                    slots=slots,
                )
            elif kind in ("release", "cancel") and issued:
                _, who, k = op
                # Mostly a request that holds a lease (a release, a cancel racing its grant),
                # else any (repeated, unknown to the backend, still queued).
                held = [rid for rid in issued if twin.redis_side.delivered.get(rid)]
                choices = held if held and k % 4 else issued
                request_id = choices[k % len(choices)]
                if kind == "release":
                    await twin.run(who, "release", pool, offers, request_id)
                else:
                    await twin.run(who, "cancel", pool, request_id)
            elif kind == "tick":
                await twin.run(op[1], "tick", pool, offers)
            elif kind == "offers":
                offers = _offers(op[1])
                continue
            elif kind == "advance":
                twin.advance(op[1])
                continue
            elif kind == "kill":
                twin.kill(op[1])
                continue
            elif kind == "heartbeat":
                await heartbeat(twin, pool, op[1])
            elif kind == "hostile":
                _, who, which = op
                values = {
                    "priority": 5,
                    "timeout_us": 1_000_000,
                    "drain_gap_us": 1,
                    "aging_us": 0,
                    "demote_after_us": None,
                    "slots": 1,
                    "tenant": "a",
                    "weight": 1,
                    **HOSTILE[which],
                }
                priority, timeout_us = values.pop("priority"), values.pop("timeout_us")
                request_id = f"r{number:04d}"
                await twin.run(
                    who, "enqueue", pool, offers, request_id, priority, timeout_us, **values
                )
            elif kind == "raw":
                await raw_call(twin, pool, offers, op[1], op[2])
                continue
            else:
                continue
            twin.check(pool, offers, before)
        preempting = twin.redis_state(pool)["preempting"]
        assert isinstance(preempting, int)
        return preempting
    finally:
        await twin.close()


def waiters(twin: Twin, issued: list[str]) -> list[str]:
    """Requests still waiting for an answer: none delivered (granted or refused) yet."""
    return [rid for rid in issued if rid not in twin.redis_side.delivered]


async def heartbeat(twin: Twin, pool: PoolPolicy, who: int) -> None:
    """Renew the leases this replica holds (a live heartbeat; restore is tested elsewhere), then
    keep liveness in the test's hands (no TTL, as ``Twin`` keeps it)."""
    name = twin.names[who]
    leases = twin.redis_state(pool)["leases"]
    assert isinstance(leases, dict)
    mine = [
        (rid, endpoint, slots)
        for rid, (endpoint, slots) in sorted(leases.items())
        if twin.redis_side.replica_of.get(rid) == name
    ]
    await twin.run(who, "heartbeat", {pool.name: mine}, restore=False)
    twin.sync.persist(twin.keys.replica(name))
    twin.hub.alive_until[name] = 1 << 62


async def raw_call(twin: Twin, pool: PoolPolicy, offers: list, who: int, which: int) -> None:
    """The enqueue script with one argument no caller sends: refused whole, nothing written."""
    backend = twin.redis[who]
    index, text = RAW_ENQUEUE[which]
    args = backend._args(pool, offers)
    own: list[str | int] = [f"raw{which}", 5, 1_000_000, pool.max_queue_size, 0, 1, 1_000_000]
    own += [0, pool.max_queue_size, 0, 1, "default", 1, 0]
    own[index] = text
    before = snapshot(twin)
    with pytest.raises(InvalidAdmissionValueError):
        await backend._run("enqueue", backend.keys.pool(pool.name), [*args, *own])
    assert snapshot(twin) == before, f"the refused call {text!r} wrote something"
    # Shared arguments too: a count of offers that the arguments do not hold.
    bad = list(args)
    bad[len(DispatchArgs.__dataclass_fields__) - 1] = "1e3"
    with pytest.raises(InvalidAdmissionValueError):
        await backend._run("tick", backend.keys.pool(pool.name), bad)
    assert snapshot(twin) == before


def snapshot(twin: Twin) -> dict[str, bytes | None]:
    return {str(key): twin.sync.dump(key) for key in sorted(twin.sync.keys("*"))}


@pytest.fixture(scope="module")
def fuzz_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("fuzz-redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    pool=pools,
    initial=st.lists(offer, min_size=1, max_size=3),
    steps=st.lists(step, min_size=20, max_size=50),
)
def test_scripts_match_the_oracle_and_keep_every_invariant(fuzz_redis, pool, initial, steps):
    asyncio.run(run_example(fuzz_redis.url, pool, initial, steps))


def _enqueue(who: int, tenant: str, weight: int = 1) -> tuple:
    return ("enqueue", who, 5, 1, 60_000_000, None, 0, 1_000_000, tenant, weight, 0)


def test_a_flood_with_preemption_matches_the_oracle(fuzz_redis):
    """A fixed example that surely preempts: A fills both engines, B and C come, A's answers end
    one by one, leases expire; on (and off: the same steps, no preempting grant)."""
    steps = [
        *[_enqueue(0, "a") for _ in range(4)],
        _enqueue(1, "b"),  # under its share: preempts A on one engine
        _enqueue(2, "c", 2),  # under its share: preempts A on the other
        _enqueue(1, "b"),  # at its share now: waits
        ("release", 0, 0),
        ("tick", 1),
        ("release", 0, 1),
        ("advance", 2_500_000),  # every lease expires: the counts with them
        ("tick", 2),
    ]
    for preempt, at_least in ((True, 2), (False, 0)):
        pool = PoolPolicy("m", max_queue_size=8, queue_timeout_s=60.0, preempt_for_share=preempt)
        made = asyncio.run(run_example(fuzz_redis.url, pool, [(2, 0.0), (2, 0.5)], steps))
        assert made >= at_least if preempt else made == 0


def _release(k: int) -> tuple:
    """Release the k-th delivered request (k % 4 != 0), or the k-th issued (k % 4 == 0)."""
    return ("release", 0, k)


def test_a_light_tenant_borrows_one_slot_that_the_flood_never_takes_back(fuzz_redis):
    """One engine of 4 slots: B holds its 2, A its 2 with 4 more waiting (backlogged). B's next
    request borrows one of A's slots; A, back under its share as its answer ends, does not take
    it back (B is over by one slot only); both backends alike, exactly one preemption."""
    steps = [
        _enqueue(0, "b"),
        _enqueue(0, "b"),
        *[_enqueue(0, "a") for _ in range(6)],  # r0002-r0003 run, r0004-r0007 wait
        _release(2),  # r0002 ends: r0004 runs (an ordinary grant)
        _enqueue(1, "b"),  # r0009: B at its share, light; A backlogged: borrows
        _release(3),  # r0003 ends: A under its share, but B only one over: nobody preempted
        _release(6),  # r0000 (B) ends: a free slot for A's next, an ordinary grant
        ("tick", 2),
    ]
    for preempt, expected in ((True, 1), (False, 0)):
        pool = PoolPolicy("m", max_queue_size=8, queue_timeout_s=60.0, preempt_for_share=preempt)
        assert asyncio.run(run_example(fuzz_redis.url, pool, [(4, 0.0)], steps)) == expected


def test_an_engine_has_at_most_half_its_slots_of_preemptions_outstanding(fuzz_redis):
    """One engine of 4 slots, A on all of them with a backlog: B and C preempt at once (two
    outstanding), D waits until one of A's answers ends, then preempts too."""
    steps = [
        *[_enqueue(0, "a") for _ in range(8)],  # r0000-r0003 run, r0004-r0007 wait
        ("release", 0, 8),  # r0000 ends: r0004 runs
        _release(1),  # r0001 ends: r0005 runs, V moves past B's, C's and D's start
        _enqueue(1, "b", 3),  # preempts A: one outstanding
        _enqueue(1, "c", 3),  # preempts A: two outstanding, the most for 4 slots
        _enqueue(2, "d", 3),  # under its share, but the engine has its two: waits
        _release(2),  # r0002 (A) ends: one outstanding, so D preempts
        ("tick", 2),
    ]
    for preempt, expected in ((True, 3), (False, 0)):
        pool = PoolPolicy("m", max_queue_size=8, queue_timeout_s=60.0, preempt_for_share=preempt)
        assert asyncio.run(run_example(fuzz_redis.url, pool, [(4, 0.0)], steps)) == expected


def test_a_request_behind_the_flooders_head_still_preempts(fuzz_redis):
    """B's second request ties with A's head in fair order and goes behind it (request ids
    decide); A's head may not preempt, so the one behind it does (``PREEMPT_SCAN``)."""
    steps = [
        *[_enqueue(0, "a") for _ in range(8)],  # r0000-r0003 run, r0004-r0007 wait
        ("release", 0, 8),  # r0000 ends: r0004 (tag 0) runs
        _release(1),  # r0001 ends: r0005 (tag 1 unit) runs; A's head r0006 is at 2 units
        _enqueue(1, "b"),  # r0010 starts at 1 unit: the head, it preempts A
        _enqueue(1, "b"),  # r0011 starts at 2 units, behind r0006: preempts from there
        ("tick", 2),
    ]
    for preempt, expected in ((True, 2), (False, 0)):
        pool = PoolPolicy("m", max_queue_size=8, queue_timeout_s=60.0, preempt_for_share=preempt)
        assert asyncio.run(run_example(fuzz_redis.url, pool, [(4, 0.0)], steps)) == expected
