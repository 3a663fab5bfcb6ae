"""``ApiServer``: the emulated Kubernetes API over HTTP, built on kmock's public API.

kmock's ``KubernetesScaffold`` serves discovery and renders errors as Kubernetes ``Status``
objects; this class adds the verbs as kmock fallback reactions (``self.fallback[action] <<
handler``), so a test can still put its own reactions in front of them with kmock's DSL (e.g.
``server["list v1/pods"] << 500``). The state and every write live in ``store.Store``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import attrs
import kmock

from .admission import Admission, Policy
from .meta import selector_matches
from .store import ObjectKey, Store

VERBS = {
    kmock.action.FETCH: "get",
    kmock.action.LIST: "list",
    kmock.action.WATCH: "watch",
    kmock.action.CREATE: "create",
    kmock.action.UPDATE: "patch",
    kmock.action.DELETE: "delete",
}


class Call(NamedTuple):
    """One API request as an RBAC rule sees it (for asserting what a client needs)."""

    user_agent: str
    verb: str
    group: str
    resource: str  # plural, or plural/subresource
    label_selector: str


class Write(NamedTuple):
    """One accepted write (create, patch, delete) as its request named it."""

    action: str  # "CREATE", "UPDATE" or "DELETE"
    resource: str  # plural, or plural/subresource
    namespace: str | None
    name: str


def resource_path(request: kmock.Request) -> str:
    """``plural`` or ``plural/subresource``: the resource as RBAC rules name it."""
    assert request.resource is not None
    plural = str(request.resource.plural)
    return f"{plural}/{request.subresource}" if request.subresource else plural


def api_version(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else str(resource.version)


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold):
    """A Kubernetes API server in memory; serve it with ``kmock.Server(api_server)``."""

    admission: Admission = attrs.field(factory=Admission)
    # Every accepted write, in order.
    writes: list[Write] = attrs.field(factory=list, init=False)
    # How many watches resumed from a resourceVersion (a client's reconnects).
    num_resumed_watches: int = attrs.field(default=0, init=False)
    _store: Store = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._store = Store(self.resources, self.admission)
        self.fallback[kmock.action.FETCH] << self._serve_fetch
        self.fallback[kmock.action.LIST] << self._serve_list
        self.fallback[kmock.action.WATCH] << self._serve_watch
        self.fallback[kmock.action.CREATE] << self._serve_create
        self.fallback[kmock.action.UPDATE] << self._serve_update
        self.fallback[kmock.action.DELETE] << self._serve_delete

    # --- what tests configure and inspect ---------------------------------------------------

    @property
    def objects(self) -> kmock.ObjectsArray:
        """Every object with its history; changing one here is a change no watch reports."""
        return self._store.objects

    @property
    def policies(self) -> list[Policy]:
        """Validating admission policies: append one to refuse (or fail) some writes."""
        return self.admission.policies

    @property
    def resource_version(self) -> int:
        """The latest resourceVersion given out (every write takes the next one)."""
        return self._store.resource_version

    @property
    def calls(self) -> list[Call]:
        """Every API request so far (not discovery), from kmock's own log of requests."""
        return [
            Call(
                request.headers.get("User-Agent", ""),
                VERBS[request.action],
                str(request.resource.group),
                resource_path(request),
                request.params.get("labelSelector", ""),
            )
            for request in self
            if request.resource is not None and request.resource.plural and request.action
        ]

    def add_crd(self, crd: dict[str, Any]) -> None:
        """Serve a CustomResourceDefinition's resource (discovery, schema) and store the CRD."""
        spec = crd["spec"]
        (version,) = [v for v in spec["versions"] if v.get("storage")]
        resource = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
        self.resources[resource] = kmock.ResourceInfo(
            kind=spec["names"]["kind"],
            singular=spec["names"]["singular"],
            namespaced=spec["scope"] == "Namespaced",
            shortnames=spec["names"].get("shortNames", []),
            categories=spec["names"].get("categories", []),
            verbs=["create", "delete", "get", "list", "patch", "update", "watch"],
            subresources=list(version.get("subresources", {})),
        )
        self.admission.schemas[resource] = version["schema"]["openAPIV3Schema"]
        crds = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        self._store.create(crds, None, crd)

    # --- reads ------------------------------------------------------------------------------

    def _known(self, request: kmock.Request) -> kmock.resource:
        if request.resource is None or request.resource not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        return request.resource

    def _key(self, request: kmock.Request) -> ObjectKey:
        assert request.name is not None  # kmock's actions with a name
        return (self._known(request), request.namespace, request.name)

    @staticmethod
    def _selects(request: kmock.Request, obj: dict[str, Any]) -> bool:
        """Whether a list or watch request (namespace, name, labelSelector) includes ``obj``."""
        meta = obj.get("metadata", {})
        return (
            (request.namespace is None or meta.get("namespace") == request.namespace)
            and (request.name is None or meta.get("name") == request.name)
            and selector_matches(request.params.get("labelSelector", ""), meta.get("labels") or {})
        )

    def _serve_fetch(self, request: kmock.Request) -> dict[str, Any]:
        return self._store.get(self._key(request))

    def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        resource = self._known(request)
        items = [obj for obj in self._store.current(resource) if self._selects(request, obj)]
        return {
            "apiVersion": api_version(resource),
            "kind": f"{self.resources[resource].kind}List",
            "metadata": {"resourceVersion": str(self._store.resource_version)},
            "items": items,
        }

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        resource = self._known(request)  # before the first chunk: a 404, not a broken stream
        yield b""  # send the headers now, even if no event comes
        since = request.params.get("resourceVersion", "")
        if since and since != "0":
            self.num_resumed_watches += 1
            position = self._store.position_after(int(since))
            replay: list[dict[str, Any]] = []
        else:  # a new watch (or "any version"): the current objects first, as ADDED
            position = len(self._store.events)
            replay = [{"type": "ADDED", "object": obj} for obj in self._store.current(resource)]
        # A server-side timeout ends the stream, so clients reconnect and resume from their
        # last resourceVersion, as they do against a real API server every few minutes.
        timeout = float(request.params.get("timeoutSeconds", 0)) or None
        try:
            async with asyncio.timeout(timeout):
                for body in replay:
                    if self._selects(request, body["object"]):
                        yield body
                while True:
                    events = await self._store.events_from(position)
                    position += len(events)
                    for event in events:
                        if event.resource == resource and self._selects(
                            request, event.body["object"]
                        ):
                            yield event.body
        except TimeoutError:
            return

    # --- writes -----------------------------------------------------------------------------

    def _written(self, request: kmock.Request, obj: dict[str, Any]) -> dict[str, Any]:
        assert request.action is not None
        meta = obj["metadata"]
        self.writes.append(
            Write(request.action.value, resource_path(request), meta.get("namespace"), meta["name"])
        )
        return obj

    def _serve_create(self, request: kmock.Request) -> dict[str, Any]:
        obj = self._store.create(self._known(request), request.namespace, request.data or {})
        return self._written(request, obj)

    def _serve_update(self, request: kmock.Request) -> dict[str, Any]:
        obj = self._store.patch(self._key(request), request.data or {}, request.subresource)
        return self._written(request, obj)

    def _serve_delete(self, request: kmock.Request) -> dict[str, Any]:
        return self._written(request, self._store.delete(self._key(request)))
