"""Priorities age: a level-9 request is served under saturating level-1 load, in bounded time.

Order is arrival time plus ``priority * aging`` (default aging 2 s a level), so a request that
has waited 8 aging steps is ahead of any level-1 request that arrives after that: its wait is
bounded by 8 * aging plus the time to serve the level-1 requests that came before.
"""

from __future__ import annotations

import asyncio
import time

from slotserve.gateway.admission.front import Admission
from slotserve.gateway.admission.types import PoolPolicy
from tests.gateway.admission_cluster import Cluster

AGING_S = 0.2
SERVICE_S = 0.05


async def _level_1(replica: Admission, pool: PoolPolicy, stop: float) -> None:
    while time.monotonic() < stop:
        lease = await replica.acquire(pool, priority=1, timeout_s=30)
        await asyncio.sleep(SERVICE_S)
        await replica.release(lease)


async def test_a_low_priority_request_is_served_under_saturating_high_priority_load(
    redis_server,
):
    for kind in ("memory", "redis"):
        cl = Cluster(kind, redis_server.url, priority_aging_s=AGING_S)
        try:
            pool = cl.serve(
                PoolPolicy("m", max_queue_size=100, queue_timeout_s=30), ("http://a", 1, 0.0)
            )
            a, b = await cl.replica(), await cl.replica()
            stop = time.monotonic() + 6
            # Always 4 level-1 requests want the one slot.
            load = [asyncio.create_task(_level_1(r, pool, stop)) for r in (a, b, a, b)]
            await asyncio.sleep(0.5)
            started = time.monotonic()
            low = await asyncio.wait_for(b.acquire(pool, priority=9, timeout_s=20), 10)
            waited = time.monotonic() - started
            await b.release(low)
            await asyncio.wait_for(asyncio.gather(*load), 20)
        finally:
            await cl.close()
        # 8 levels * 0.2 s, plus up to 4 level-1 requests ahead at 0.05 s each, plus slack.
        print(f"{kind}: level 9 served after {waited:.2f} s under level-1 load")
        assert waited < 8 * AGING_S + 4 * SERVICE_S + 1.0, (kind, waited)
        assert waited > 8 * AGING_S * 0.5, (kind, waited)  # and it did wait its turn
