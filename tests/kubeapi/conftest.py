"""Fixtures of the emulator's own tests: the server on a thread (for the blocking kubernetes
client) or in the test's event loop (for watches read line by line)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import kmock
import kubernetes.client
import pytest

from .server import ApiServer
from .thread import ApiServerThread
from .widget_crd import WIDGET_CRD, Widgets


@pytest.fixture
def apiserver() -> Iterator[ApiServerThread]:
    """The emulator on its own thread, serving the widget CRD."""
    running = ApiServerThread([WIDGET_CRD]).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def api_client(apiserver: ApiServerThread) -> kubernetes.client.ApiClient:
    configuration = kubernetes.client.Configuration()
    configuration.host = apiserver.url
    return kubernetes.client.ApiClient(configuration)


@pytest.fixture
def widgets(api_client: kubernetes.client.ApiClient) -> Widgets:
    return Widgets(kubernetes.client.CustomObjectsApi(api_client))


@pytest.fixture
def core(api_client: kubernetes.client.ApiClient) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(api_client)


@pytest.fixture
async def server() -> AsyncIterator[ApiServer]:
    """The emulator in the test's own event loop; ``server.get(...)`` etc. are its HTTP client."""
    async with ApiServer() as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        emulator.add_crd(WIDGET_CRD)
        yield emulator
