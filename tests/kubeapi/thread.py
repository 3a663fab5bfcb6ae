"""``ApiServerThread``: an ``ApiServer`` on its own thread and event loop, for blocking tests.

Synchronous clients (the ``kubernetes`` package, a kopf operator on its own loop, other
processes) talk to it over HTTP at ``url``; ``kubeconfig()`` is a kubeconfig that points at it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import kmock

from .server import ApiServer


class ApiServerThread:
    """Start with ``.start()``, stop with ``.stop()``; ``server`` is the live ``ApiServer``."""

    def __init__(self, crds: list[dict[str, Any]]) -> None:
        self._crds = crds
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="apiserver", daemon=True)
        self.url = ""
        self.server: ApiServer | None = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:
            self.error = error
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with ApiServer() as server, kmock.Server(server) as http:
            server.resources.load_bundled()
            for crd in self._crds:
                server.add_crd(crd)
            self.server, self.url = server, str(http.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self, timeout: float = 10) -> ApiServerThread:
        self._thread.start()
        if not self._ready.wait(timeout) or self.error is not None:
            raise RuntimeError(f"the API server did not start: {self.error!r}")
        return self

    def stop(self, timeout: float = 10) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def kubeconfig(self) -> str:
        """A kubeconfig (JSON, which is YAML) whose current context is this server."""
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                "users": [{"name": "kmock", "user": {"token": "test-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
                "current-context": "kmock",
            }
        )
