"""Watches on the emulator, read line by line over plain HTTP in the test's own event loop:
the initial ADDED events, live events in order, resumption from a resourceVersion, filters,
server-side timeouts; and kmock reactions placed in front of the emulator."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from .server import ApiServer
from .widget_crd import widget

WIDGETS = "/apis/test.kubeapi.dev/v1/namespaces/ns/widgets"
WAIT = 5.0


class Watch:
    """One open watch stream; ``next()`` is the next event, bounded by ``WAIT``."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(self) -> dict[str, Any]:
        line = await asyncio.wait_for(self.response.content.readline(), WAIT)
        assert line, "the stream ended"
        return json.loads(line)

    async def quiet(self, seconds: float = 0.3) -> bool:
        """Whether no event comes within ``seconds``."""
        try:
            await asyncio.wait_for(self.response.content.readline(), seconds)
        except TimeoutError:
            return True
        return False


@asynccontextmanager
async def watching(server: ApiServer, path: str = WIDGETS, **params: str) -> AsyncIterator[Watch]:
    async with server.get(path, params={"watch": "true", **params}) as response:
        assert response.status == 200
        yield Watch(response)


async def create(server: ApiServer, body: dict[str, Any], path: str = WIDGETS) -> dict[str, Any]:
    async with server.post(path, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def patch(server: ApiServer, name: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Content-Type": "application/merge-patch+json"}
    async with server.patch(f"{WIDGETS}/{name}", data=json.dumps(body), headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def delete(server: ApiServer, name: str) -> None:
    async with server.delete(f"{WIDGETS}/{name}") as response:
        assert response.status == 200, await response.text()


def summary(event: dict[str, Any]) -> tuple[str, str]:
    return event["type"], event["object"]["metadata"]["name"]


async def test_a_new_watch_lists_then_follows_every_write_in_order(server: ApiServer):
    await create(server, widget("old"))
    async with watching(server) as watch:
        assert summary(await watch.next()) == ("ADDED", "old")
        await create(server, widget("new"))
        await patch(server, "new", {"spec": {"color": "blue"}})
        await delete(server, "old")
        events = [await watch.next() for _ in range(3)]
        assert [summary(e) for e in events] == [
            ("ADDED", "new"),
            ("MODIFIED", "new"),
            ("DELETED", "old"),
        ]
        assert events[1]["object"]["spec"]["color"] == "blue"
        versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
        assert versions == sorted(versions) and len(set(versions)) == 3


async def test_a_resumed_watch_replays_only_what_came_after_its_version(server: ApiServer):
    first = await create(server, widget("first"))
    await patch(server, "first", {"spec": {"color": "blue"}})
    await create(server, widget("second"))
    since = first["metadata"]["resourceVersion"]
    async with watching(server, resourceVersion=since) as watch:
        assert summary(await watch.next()) == ("MODIFIED", "first")
        assert summary(await watch.next()) == ("ADDED", "second")
        assert await watch.quiet()
    assert server.num_resumed_watches == 1

    async with watching(server, resourceVersion="0") as watch:  # "any version": a fresh start
        assert sorted([summary(await watch.next()) for _ in range(2)]) == [
            ("ADDED", "first"),
            ("ADDED", "second"),
        ]
    assert server.num_resumed_watches == 1


async def test_watches_see_only_their_namespace_labels_and_resource(server: ApiServer):
    async with (
        watching(server, labelSelector="tier=web") as labelled,
        watching(server, "/apis/test.kubeapi.dev/v1/widgets") as cluster_wide,
    ):
        await create(server, widget("plain"))
        await create(server, widget("web", labels={"tier": "web"}))
        await create(server, {"metadata": {"name": "cm"}}, "/api/v1/namespaces/ns/configmaps")
        await create(server, widget("far"), "/apis/test.kubeapi.dev/v1/namespaces/far/widgets")
        assert summary(await labelled.next()) == ("ADDED", "web")
        assert await labelled.quiet()
        names = [summary(await cluster_wide.next())[1] for _ in range(3)]
        assert names == ["plain", "web", "far"] and await cluster_wide.quiet()


async def test_a_server_side_timeout_ends_the_stream(server: ApiServer):
    started = time.monotonic()
    async with server.get(WIDGETS, params={"watch": "true", "timeoutSeconds": "1"}) as response:
        body = await asyncio.wait_for(response.read(), WAIT)
    assert body.strip() == b"" and 0.9 <= time.monotonic() - started < WAIT


async def test_unknown_resources_are_404_not_an_empty_stream(server: ApiServer):
    async with server.get("/apis/nowhere.dev/v1/gadgets", params={"watch": "true"}) as response:
        assert response.status == 404
        assert (await response.json())["kind"] == "Status"
    async with server.get("/apis/nowhere.dev/v1/gadgets") as response:
        assert response.status == 404


async def test_kmock_reactions_go_in_front_of_the_emulator(server: ApiServer):
    server["list test.kubeapi.dev/v1/widgets"] << 503 << {"kind": "Status", "code": 503}
    async with server.get(WIDGETS) as response:
        assert response.status == 503
    async with server.get("/api/v1/namespaces/ns/configmaps") as response:
        assert response.status == 200 and (await response.json())["kind"] == "ConfigMapList"


async def test_discovery_serves_the_crd_resource(server: ApiServer):
    async with server.get("/apis/test.kubeapi.dev/v1") as response:
        resources = {r["name"]: r for r in (await response.json())["resources"]}
    assert resources["widgets"]["kind"] == "Widget" and resources["widgets"]["namespaced"]
    assert {"widgets/status", "widgets/scale"} <= resources.keys()
