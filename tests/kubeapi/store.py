"""The state of the emulated API server: objects, resourceVersions, the event log, the GC.

Objects live in a ``kmock.ObjectsArray`` (each with its history, for assertions). Every write
takes the next ``resourceVersion`` of one server-wide counter and appends an event to a log
that watches follow and resume from. Writes are synchronous: on the server's single event loop
each one is atomic, so a watch's snapshot and its place in the log always line up.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

import jsonpatch
import kmock

from .admission import Admission
from .meta import essence, merge_patch, now

ObjectKey = tuple[kmock.resource, str | None, str]


@dataclass(frozen=True)
class Event:
    """One write as watches see it: ``body`` is ``{"type": ..., "object": ...}``."""

    resource_version: int
    resource: kmock.resource
    body: dict[str, Any]


def conflict(message: str, reason: str = "Conflict") -> kmock.KubernetesError:
    return kmock.KubernetesError(status=409, reason=reason, message=message)


class Store:
    """Objects by (resource, namespace, name), and the writes that change them."""

    def __init__(self, resources: kmock.ResourcesArray, admission: Admission) -> None:
        self.resources = resources
        self.admission = admission
        self.objects = kmock.ObjectsArray()
        self.resource_version = 1000
        self.events: list[Event] = []
        self._changed = asyncio.Event()

    # --- reads ----------------------------------------------------------------------------

    def live(self, key: ObjectKey) -> dict[str, Any] | None:
        """The stored object (not a copy), unless it does not exist or was deleted."""
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def get(self, key: ObjectKey) -> dict[str, Any]:
        obj = self.live(key)
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        return copy.deepcopy(obj)

    def current(self, resource: kmock.resource) -> list[dict[str, Any]]:
        """Copies of every live object of ``resource``."""
        return [
            copy.deepcopy(obj.raw)
            for (res, _, _), obj in self.objects.items()
            if res == resource and not obj.deleted
        ]

    def position_after(self, resource_version: int) -> int:
        """Where in the event log the events after ``resource_version`` begin."""
        return bisect.bisect_right(self.events, resource_version, key=lambda e: e.resource_version)

    async def events_from(self, position: int) -> list[Event]:
        """The events from ``position`` on, waiting until there is at least one."""
        while len(self.events) <= position:
            await self._changed.wait()
        return self.events[position:]

    # --- writes ---------------------------------------------------------------------------

    def create(
        self, resource: kmock.resource, namespace: str | None, body: dict[str, Any]
    ) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        namespace = namespace or meta.get("namespace")
        name = meta.get("name") or meta.get("generateName", "obj-") + secrets.token_hex(3)
        key = (resource, namespace, name)
        if self.live(key) is not None:
            raise conflict(f'"{name}" already exists', reason="AlreadyExists")
        if self._has_status(resource):
            obj.pop("status", None)
        meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        if namespace is not None:
            meta["namespace"] = namespace
        self._admit(resource, obj)
        meta["resourceVersion"] = self._next_resource_version()
        if key in self.objects:
            self.objects[key].create(obj)  # a new life after a deletion: the history goes on
        else:
            self.objects[key] = obj
        self._publish(resource, "ADDED", obj)
        return obj

    def patch(self, key: ObjectKey, patch: Any, subresource: str | None) -> dict[str, Any]:
        """A JSON patch (a list) or a merge patch (an object) of the object or a subresource."""
        resource = key[0]
        live = self.get(key)
        if subresource == "scale":
            patch = {"spec": {"replicas": patch["spec"]["replicas"]}}
        if isinstance(patch, list):
            new = jsonpatch.apply_patch(live, patch, in_place=False)
        else:
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted and wanted != live["metadata"]["resourceVersion"]:
                raise conflict(
                    "the object has been modified; please apply your changes to the latest "
                    "version and try again"
                )
            if subresource == "status":
                patch = {"status": patch.get("status")}
            elif self._has_status(resource):
                patch = {name: value for name, value in patch.items() if name != "status"}
            new = merge_patch(live, patch)
        meta = new.setdefault("metadata", {})
        for name in ("uid", "creationTimestamp", "name", "namespace", "generation"):
            if name in live["metadata"]:
                meta[name] = live["metadata"][name]
        meta["resourceVersion"] = live["metadata"]["resourceVersion"]
        if essence(new) != essence(live):
            meta["generation"] = int(live["metadata"].get("generation", 1)) + 1
        self._admit(resource, new)
        if new == live:
            return live  # a no-op write changes nothing, not even the resourceVersion
        meta["resourceVersion"] = self._next_resource_version()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(key, new)  # the last finalizer is gone
        else:
            self.objects[key].create(new)
            self._publish(resource, "MODIFIED", new)
        return new

    def delete(self, key: ObjectKey) -> dict[str, Any]:
        """Delete now, or mark for deletion (deletionTimestamp) while finalizers remain."""
        live = self.get(key)
        meta = live["metadata"]
        if meta.get("deletionTimestamp"):
            return live
        meta["resourceVersion"] = self._next_resource_version()
        if meta.get("finalizers"):
            meta["deletionTimestamp"] = now()
            self.objects[key].create(live)
            self._publish(key[0], "MODIFIED", live)
        else:
            self._remove(key, live)
        return live

    def _remove(self, key: ObjectKey, last: dict[str, Any]) -> None:
        self.objects[key].delete()
        self._publish(key[0], "DELETED", last)
        self._collect_dependents(last["metadata"].get("uid"))

    def _collect_dependents(self, owner_uid: str | None) -> None:
        """The garbage collector, background propagation: the objects that named ``owner_uid``
        among their ownerReferences go once all their owners are gone (and theirs after them).
        """
        alive = {obj.raw["metadata"].get("uid") for obj in self.objects.values() if not obj.deleted}
        for key, obj in list(self.objects.items()):
            if obj.deleted:
                continue
            owners = {ref.get("uid") for ref in obj.raw["metadata"].get("ownerReferences", [])}
            if owner_uid in owners and not owners & alive:
                self.delete(key)

    # --- helpers --------------------------------------------------------------------------

    def _has_status(self, resource: kmock.resource) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _admit(self, resource: kmock.resource, obj: dict[str, Any]) -> None:
        kind = self.resources[resource].kind if resource in self.resources else None
        self.admission.admit(resource, kind or str(resource.plural), obj)

    def _next_resource_version(self) -> str:
        self.resource_version += 1
        return str(self.resource_version)

    def _publish(self, resource: kmock.resource, kind: str, obj: dict[str, Any]) -> None:
        body = {"type": kind, "object": copy.deepcopy(obj)}
        self.events.append(Event(int(obj["metadata"]["resourceVersion"]), resource, body))
        # Wake every waiting watch; the next ones wait on a fresh event.
        self._changed.set()
        self._changed = asyncio.Event()
