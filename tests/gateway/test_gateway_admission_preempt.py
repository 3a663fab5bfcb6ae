"""Preemption for a tenant under its share (issue 26, ``preempt_share.py``, ``lua/preempt.py``).

Both backends (in-process, and a real redis-server with several replicas): a request of a tenant
holding fewer slots than its weighted share of the pool is granted at once on a full engine as a
preempting grant naming the tenant over its share, exactly when the rule says; at most half an
engine's slots (at least one) outstanding on it; a light tenant at its share borrows one slot of
a backlogged one, which does not take it back; the held-slot counts follow the leases and return
to nothing when they end, by release or by expiry; and a pool that turns it off waits as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis

from slotserve.gateway.admission.front import Admission, Lease
from slotserve.gateway.admission.types import PoolPolicy
from tests.gateway.admission_cluster import Cluster, waiting_count

ENGINE = "http://a"


def _pool(cluster: Cluster, *, preempt: bool = True, slots: int = 2) -> PoolPolicy:
    policy = PoolPolicy("m", max_queue_size=64, queue_timeout_s=30, preempt_for_share=preempt)
    return cluster.serve(policy, (ENGINE, slots, 0.0))


def _held(cluster: Cluster, pool: PoolPolicy) -> Callable[[], dict[str, int]]:
    """Slots held per tenant in the pool, read from the backend itself."""
    if cluster.kind == "memory":
        return lambda: dict(cluster.hub.pool(pool.name).tenant_held)
    assert cluster.redis_url is not None
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    key = f"{cluster.prefix}:{{{pool.name}}}:tenant_held"
    return lambda: {str(k): int(v) for k, v in client.hgetall(key).items()}


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


def _acquire(replica: Admission, pool: PoolPolicy, tenant: str) -> asyncio.Task[Lease]:
    return asyncio.ensure_future(replica.acquire(pool, 5, 30, tenant=tenant))


async def _fill(replica: Admission, pool: PoolPolicy, tenant: str, n: int) -> list[Lease]:
    return [await replica.acquire(pool, 5, 30, tenant=tenant) for _ in range(n)]


async def test_an_under_share_tenant_preempts_at_once_and_never_twice_per_engine(cluster):
    pool = _pool(cluster)
    first, second, third = [await cluster.replica() for _ in range(3)]
    waiting, held = waiting_count(cluster, pool), _held(cluster, pool)
    leases_a = await _fill(first, pool, "a", 2)
    assert all(lease.preempt_tenant is None for lease in leases_a)
    # B holds nothing of its share (1 of 2 slots): granted at once, taking one of A's.
    lease_b = await asyncio.wait_for(second.acquire(pool, 5, 30, tenant="b"), 5)
    assert (lease_b.endpoint, lease_b.preempt_tenant) == (ENGINE, "a")
    assert held() == {"a": 2, "b": 1}
    # C is under its share too (2/3 of a slot among three tenants), but the engine of 2 slots
    # already has its one outstanding preemption: C waits.
    task_c = _acquire(third, pool, "c")
    await _until(lambda: waiting() == 1, "C queued")
    assert not task_c.done()
    # One of A's answers ends: the engine is exactly full again, so C preempts A (over its
    # share with one slot of 2 among three tenants).
    await first.release(leases_a.pop())
    lease_c = await asyncio.wait_for(task_c, 5)
    assert lease_c.preempt_tenant == "a"
    assert held() == {"a": 1, "b": 1, "c": 1}
    # B at its share waits, however full the engine is.
    more_b = _acquire(second, pool, "b")
    await _until(lambda: waiting() == 1, "B's second request queued")
    await first.release(leases_a.pop())  # exactly full again, but nobody is over the share
    assert not more_b.done()
    await second.release(lease_b)
    lease_b2 = await asyncio.wait_for(more_b, 5)
    assert lease_b2.preempt_tenant is None  # a free slot: an ordinary grant
    await second.release(lease_b2)
    await third.release(lease_c)
    await _until(lambda: held() == {}, "every held count back to nothing")


async def test_weights_decide_the_share(cluster):
    pool = _pool(cluster, slots=4)
    replica = await cluster.replica()
    leases = [await replica.acquire(pool, 5, 30, tenant="a", weight=1) for _ in range(3)]
    leases.append(await replica.acquire(pool, 5, 30, tenant="b", weight=3))
    # B holds 1 of its 3/4 x 4 = 3 slots: it preempts A (3 held, over its 1).
    lease = await asyncio.wait_for(replica.acquire(pool, 5, 30, tenant="b", weight=3), 5)
    assert lease.preempt_tenant == "a"
    for held_lease in [*leases, lease]:
        await replica.release(held_lease)


async def test_held_counts_end_with_expired_leases(cluster):
    pool = _pool(cluster)
    doomed, survivor = await cluster.replica(), await cluster.replica()
    held = _held(cluster, pool)
    await _fill(doomed, pool, "a", 2)
    assert held() == {"a": 2}
    await doomed.close()  # no release, no heartbeat: its leases expire after the lease TTL
    await _until(lambda: held() == {}, "expired leases' counts gone")
    lease = await asyncio.wait_for(survivor.acquire(pool, 5, 30, tenant="b"), 5)
    assert lease.preempt_tenant is None  # the slots are free again: an ordinary grant
    await survivor.release(lease)
    assert held() == {}


async def test_a_pool_without_preemption_waits_for_an_answer_to_end(cluster):
    pool = _pool(cluster, preempt=False)
    replica = await cluster.replica()
    waiting = waiting_count(cluster, pool)
    leases = await _fill(replica, pool, "a", 2)
    task = _acquire(replica, pool, "b")
    await _until(lambda: waiting() == 1, "B queued")
    assert not task.done()
    await replica.release(leases.pop())
    lease = await asyncio.wait_for(task, 5)
    assert lease.preempt_tenant is None
    for held_lease in [*leases, lease]:
        await replica.release(held_lease)


async def test_an_engine_has_at_most_half_its_slots_of_preemptions_outstanding(cluster):
    pool = _pool(cluster, slots=4)
    replica = await cluster.replica()
    waiting, held = waiting_count(cluster, pool), _held(cluster, pool)
    leases_a = await _fill(replica, pool, "a", 4)
    # B and C hold nothing of their shares: both preempt A at once (two outstanding, 4 / 2).
    lease_b = await asyncio.wait_for(replica.acquire(pool, 5, 30, tenant="b"), 5)
    lease_c = await asyncio.wait_for(replica.acquire(pool, 5, 30, tenant="c"), 5)
    assert (lease_b.preempt_tenant, lease_c.preempt_tenant) == ("a", "a")
    # D is under its share too, but the engine has its two outstanding: D waits.
    task_d = _acquire(replica, pool, "d")
    await _until(lambda: waiting() == 1, "D queued")
    await asyncio.sleep(0.2)
    assert not task_d.done()
    # One of A's answers ends: one outstanding again, and A is still over its share.
    await replica.release(leases_a.pop())
    lease_d = await asyncio.wait_for(task_d, 5)
    assert lease_d.preempt_tenant == "a"
    assert held() == {"a": 3, "b": 1, "c": 1, "d": 1}
    for lease in [*leases_a, lease_b, lease_c, lease_d]:
        await replica.release(lease)
    await _until(lambda: held() == {}, "every held count back to nothing")


async def test_a_light_tenant_borrows_one_slot_and_the_flood_never_takes_it_back(cluster):
    pool = _pool(cluster, slots=4)
    replica = await cluster.replica()
    waiting, held = waiting_count(cluster, pool), _held(cluster, pool)
    leases_b = await _fill(replica, pool, "b", 2)
    leases_a = await _fill(replica, pool, "a", 2)
    # A floods: four more wait (more than its share of 2 and one: A is backlogged).
    flood = [_acquire(replica, pool, "a") for _ in range(4)]
    await _until(lambda: waiting() == 4, "A's flood queued")
    await replica.release(leases_a.pop(0))  # an answer of A ends: A's next takes its slot
    await _until(lambda: sum(task.done() for task in flood) == 1, "A's next granted")
    leases_a += [task.result() for task in flood if task.done()]
    flood = [task for task in flood if not task.done()]
    assert held() == {"a": 2, "b": 2}
    # B at its share with nothing else waiting (light) borrows one of the flooder's slots.
    borrowed = await asyncio.wait_for(replica.acquire(pool, 5, 30, tenant="b"), 5)
    assert borrowed.preempt_tenant == "a"
    assert held() == {"a": 2, "b": 3}
    # An answer of A ends: A is under its share, but B is over by one slot only, so A waits
    # (no preemption back and forth) ...
    await replica.release(leases_a.pop(0))
    await asyncio.sleep(0.3)
    assert not any(task.done() for task in flood)
    assert held() == {"a": 1, "b": 3}
    # ... until an answer ends: then an ordinary grant.
    await replica.release(leases_b.pop())
    await _until(lambda: sum(task.done() for task in flood) == 1, "A's next granted")
    leases_a += [task.result() for task in flood if task.done()]
    assert all(lease.preempt_tenant is None for lease in leases_a)
    for task in flood:
        task.cancel()
    for lease in [*leases_a, *leases_b, borrowed]:
        await replica.release(lease)
    await _until(lambda: held() == {}, "every held count back to nothing")
