"""Gateway fixtures (helpers live in gateway_support.py)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from slotserve.gateway.http.app import create_app
from slotserve.gateway.settings import GatewaySettings
from tests.gateway.admission_cluster import cluster  # noqa: F401  (fixture: replicas over either backend)
from tests.gateway.gateway_support import Spawner, write_pools
from tests.support import free_port


@pytest.fixture
def spawn(tmp_path: Path):
    spawner = Spawner(tmp_path)
    try:
        yield spawner
    finally:
        spawner.stop_all()


async def start_gateway(settings: GatewaySettings):
    runner = web.AppRunner(create_app(settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", settings.port).start()
    return runner


@pytest.fixture
async def gw(tmp_path: Path, spawn):
    """Factory: gw(pools, **settings) -> base URL; stops every gateway at teardown."""
    runners = []

    async def make(pools: list[dict], **overrides) -> str:
        port = free_port()
        pool_file = write_pools(tmp_path / f"pools-{port}.yaml", pools)
        settings = GatewaySettings(host="127.0.0.1", port=port, config=pool_file, **overrides)
        runners.append(await start_gateway(settings))
        return f"http://127.0.0.1:{port}"

    yield make
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def client():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
