"""Several ``Admission`` objects over one shared backend, standing for several gateway replicas.

Used by the admission suites with both backends: in-process, and a real redis-server.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable

import pytest
import redis

from slotserve.gateway.admission.backends.memory import InProcessBackend, InProcessHub
from slotserve.gateway.admission.backends.redis import RedisBackend
from slotserve.gateway.admission.front import Admission
from slotserve.gateway.admission.types import AdmissionBackend, PoolPolicy
from slotserve.gateway.pools.routing import EndpointOffer

LEASE_TTL_S = 1.0


class Cluster:
    """Replicas sharing one backend; offers and pools are plain dicts the test edits."""

    def __init__(
        self,
        kind: str,
        redis_url: str | None,
        lease_ttl_s: float = LEASE_TTL_S,
        priority_aging_s: float = 2.0,
    ) -> None:
        self.priority_aging_s = priority_aging_s
        self.kind = kind
        self.redis_url = redis_url
        self.lease_ttl_s = lease_ttl_s
        self.hub = InProcessHub(lease_ttl_s=lease_ttl_s)
        self.prefix = f"t{uuid.uuid4().hex[:6]}"
        self.offers: dict[str, list[EndpointOffer]] = {}
        self.pools: dict[str, PoolPolicy] = {}
        self.replicas: list[Admission] = []

    def serve(
        self,
        pool: PoolPolicy,
        *endpoints: tuple[str, int, float]
        | tuple[str, int, float, int]
        | tuple[str, int, float, int, int],
    ) -> PoolPolicy:
        """Serve ``pool`` on endpoints given as (url, slots, engine load score[, empty rows[,
        ms its next row to evict sat unused]]), reports read just now."""
        self.pools[pool.name] = pool
        offers = []
        for url, slots, load, *extra in endpoints:
            rows, idle = (extra[0] if extra else 0), (extra[1] if len(extra) > 1 else 0)
            offers.append(EndpointOffer(url, slots, load, rows_free=rows, row_idle_ms=idle))
        self.offers[pool.name] = offers
        return pool

    async def replica(self) -> Admission:
        replica_id = f"r{len(self.replicas)}-{uuid.uuid4().hex[:4]}"
        backend: AdmissionBackend
        if self.kind == "memory":
            backend = InProcessBackend(self.hub, replica_id)
        else:
            assert self.redis_url is not None, "a Redis cluster needs its server"
            backend = RedisBackend(
                self.redis_url, replica_id, prefix=self.prefix, lease_ttl_s=self.lease_ttl_s
            )
        admission = Admission(
            backend,
            offers=lambda name: self.offers.get(name, []),
            pools=lambda: list(self.pools.values()),
            lease_ttl_s=self.lease_ttl_s,
            tick_interval_s=0.05,
            idle_tick_interval_s=0.1,
            priority_aging_s=self.priority_aging_s,
        )
        await admission.start()
        self.replicas.append(admission)
        return admission

    async def close(self) -> None:
        for admission in self.replicas:
            with contextlib.suppress(Exception):
                await admission.close()


@pytest.fixture(params=["memory", "redis"])
async def cluster(request):
    """A cluster over each backend; a test module may set ``CLUSTER_LEASE_TTL_S`` for its own."""
    redis_url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    ttl = getattr(request.module, "CLUSTER_LEASE_TTL_S", LEASE_TTL_S)
    cl = Cluster(request.param, redis_url, lease_ttl_s=ttl)
    try:
        yield cl
    finally:
        await cl.close()


def waiting_count(cluster: Cluster, pool: PoolPolicy) -> Callable[[], int]:
    """How many requests wait in the shared queue, read from the backend itself."""
    if cluster.kind == "memory":
        return lambda: len(cluster.hub.pool(pool.name).queue)
    assert cluster.redis_url is not None
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    key = f"{cluster.prefix}:{{{pool.name}}}:queue"
    return lambda: int(client.zcard(key))
