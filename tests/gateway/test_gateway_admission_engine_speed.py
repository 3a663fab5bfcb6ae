"""Retry-After before any drain has been seen: the engines' own speed from their ``/load``
(``mean_request_seconds``), not a constant; on both backends, and the field from a real engine."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from slotserve.gateway.admission.drain import (
    DrainRate,
    HoldTime,
    engines_rate_per_s,
    promise_gap_us,
    service_rate_per_s,
)
from slotserve.gateway.admission.types import PoolPolicy, QueueFullError
from slotserve.gateway.pools.routing import EndpointOffer
from tests.gateway.admission_cluster import Cluster


def test_the_engines_speed_is_the_last_resort_before_nothing():
    offers = [EndpointOffer("a", 4, 0.0, 0.5), EndpointOffer("b", 4, 0.0, 0.0)]
    engines = engines_rate_per_s(offers)
    assert engines == 8  # a: 4 slots at 0.5 s; b has finished nothing yet
    drain, hold = DrainRate(), HoldTime()
    assert service_rate_per_s(drain, hold, 8, engines) == 8
    drain.observe(0.0, 100)
    drain.observe(1.0, 130)
    assert service_rate_per_s(drain, hold, 8, engines) == 30  # a drain seen wins
    hold.observe(0.5)
    assert service_rate_per_s(drain, hold, 8, engines) == 16  # then what this replica measured


async def test_first_retry_after_comes_from_the_engines_speed(cluster: Cluster):
    # One slot whose engine says a request takes 5 s: places free every ~5.9 s (the promise
    # spacing's safety margin), where nothing known would say 1 s.
    pool = cluster.serve(
        PoolPolicy("m", max_queue_size=1, queue_timeout_s=30), ("http://a", 1, 0.0)
    )
    cluster.offers["m"] = [EndpointOffer("http://a", 1, 0.0, 5.0)]
    a = await cluster.replica()
    assert promise_gap_us(a.service_rate("m")) == pytest.approx(5.88e6, rel=0.01)
    busy = await a.acquire(pool, 5, 30)
    queued = asyncio.create_task(a.acquire(pool, 5, 30))
    await asyncio.sleep(0.1)
    with pytest.raises(QueueFullError) as info:
        await a.acquire(pool, 5, 30)
    assert info.value.retry_after_s == 6
    await a.release(busy)
    await a.release(await asyncio.wait_for(queued, 5))


async def test_a_real_engine_reports_its_mean_seconds_per_request(tiny_model_dir):
    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.http.server import create_app
    from slotserve.engine.settings import EngineSettings

    settings = EngineSettings(model=str(tiny_model_dir), served_model_name="tiny", num_threads=1)
    engine = await asyncio.to_thread(AsyncEngine.load, settings)
    client = TestClient(TestServer(create_app(engine)))
    await client.start_server()
    try:
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.05)
        assert (await (await client.get("/load")).json())["mean_request_seconds"] == 0
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        mean_s = (await (await client.get("/load")).json())["mean_request_seconds"]
        assert 0 < mean_s < 30
    finally:
        await client.close()
