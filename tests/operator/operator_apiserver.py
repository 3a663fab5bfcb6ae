"""A Kubernetes API server for tests: kmock's emulator plus the few behaviours kopf relies on.

kmock 0.8 (``KubernetesEmulator``) stores objects and streams watch events, but it is not an API
server. This shim adds, each in one commented place below, what the operator and kopf need:

1. ``metadata.resourceVersion`` that grows with every write (kopf patches and resumes with it),
   plus uid, creationTimestamp and generation (bumped when spec changes).
2. Watch resumption: ``?watch=true&resourceVersion=N`` replays the events after N from a log,
   instead of re-sending every object as ADDED (which makes kopf run on.create twice).
3. Custom resources are defaulted, pruned and validated against the CRD's openAPIV3Schema;
   violations answer 422 Invalid like the real server. CEL rules (x-kubernetes-validations)
   are NOT evaluated: the operator's pydantic models check the same rules themselves.
   Deployments, Services and Pods are validated (as written, after every patch) against
   Kubernetes 1.37's schemas with kubernetes-validate, strict: types and unknown fields, not
   the server's semantic checks. ``policies`` stand in for validating admission webhooks
   (Kyverno, Gatekeeper): a callable that returns a message denies the write with 422.
4. ``kind``/``apiVersion``/``resourceVersion`` in list responses, and ``labelSelector``
   filtering of lists and watches (equality and existence terms).
5. Status subresource semantics (status ignored on the main endpoint, only status taken on
   ``/status``), the ``/scale`` subresource, and compare-and-swap on a patch's resourceVersion
   (409 Conflict), no-op patches leaving the object (and its resourceVersion) untouched.
6. The garbage collector: deleting an object deletes the objects whose ownerReferences name its
   uid (background propagation), recursively. This is how cleanup through owner references is
   tested: kmock itself has no garbage collector.

Everything else (admission webhooks, field managers, CEL, server-side apply) is out of scope.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import jsonpatch
import jsonschema
import kmock
import kubernetes_validate
from kmock._internal import dicts, rendering

K8S_VERSION = "1.37.0"
BUILTIN_VALIDATED = {"deployments", "services", "pods", "networkpolicies"}
MUTATIONS = {kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE}
VERBS = {
    kmock.action.FETCH: "get",
    kmock.action.LIST: "list",
    kmock.action.WATCH: "watch",
    kmock.action.CREATE: "create",
    kmock.action.UPDATE: "patch",
    kmock.action.DELETE: "delete",
}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def label_matches(term: str, labels: dict[str, str]) -> bool:
    """One term of a label selector: key, !key, key=value, key==value, key!=value.

    (Set-based terms are not needed here. Unlike a real server, a watch does not turn an object
    that stops matching into a DELETED event; the operator's labels never change.)
    """
    if "!=" in term:
        key, value = term.split("!=", 1)
        return labels.get(key) != value
    if "=" in term:
        key, value = term.replace("==", "=").split("=", 1)
        return labels.get(key) == value
    if term.startswith("!"):
        return term[1:] not in labels
    return term in labels


def resource_plural(request: rendering.Request) -> str:
    assert request.resource is not None
    plural = str(request.resource.plural)
    return f"{plural}/{request.subresource}" if request.subresource else plural


def _essence(obj: dict[str, Any]) -> dict[str, Any]:
    """What bumps metadata.generation when it changes: everything but metadata and status."""
    return {key: value for key, value in obj.items() if key not in {"metadata", "status"}}


def apply_defaults(schema: dict[str, Any], value: Any) -> None:
    """Fill in schema defaults in place, top-down, like the API server's defaulting."""
    if isinstance(value, dict):
        for name, child in schema.get("properties", {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
        for name, item in value.items():
            child = schema.get("properties", {}).get(name)
            if child is None and isinstance(schema.get("additionalProperties"), dict):
                child = schema["additionalProperties"]
            if child is not None:
                apply_defaults(child, item)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(schema["items"], item)


def prune(schema: dict[str, Any], value: Any) -> None:
    """Drop fields the schema does not declare, in place (structural-schema pruning)."""
    if isinstance(value, dict) and "properties" in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            for name in [name for name in value if name not in schema["properties"]]:
                del value[name]
        for name, item in value.items():
            if name != "metadata":
                prune(schema["properties"][name], item)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for item in value.values():
            prune(schema["additionalProperties"], item)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            prune(schema["items"], item)


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator with resourceVersions, resumable watches, CRD validation and GC."""

    # openAPIV3Schema of custom resources, by resource; objects of these are validated.
    schemas: dict[kmock.resource, dict[str, Any]] = attrs.field(factory=dict)
    # Validating admission: (plural, object) -> a denial message, or "" to allow.
    policies: list[Callable[[str, dict[str, Any]], str]] = attrs.field(factory=list)
    _rv: int = attrs.field(default=1000, init=False)
    # (resourceVersion, resource, event) of every write, for watch resumption.
    _log: list[tuple[int, kmock.resource, dict[str, Any]]] = attrs.field(factory=list, init=False)
    # (action, plural, namespace, name) of every accepted write, for assertions in tests.
    writes: list[tuple[str, str, str | None, str]] = attrs.field(factory=list, init=False)
    # (user agent, verb, group, resource[/subresource], labelSelector) of every API request.
    calls: list[tuple[str, str, str, str, str]] = attrs.field(factory=list, init=False)
    # How many watches resumed from a resourceVersion (reconnects), for assertions in tests.
    num_resumed_watches: int = attrs.field(default=0, init=False)
    # The object each mutating request produced, handed to the response renderers.
    _results: dict[int, dict[str, Any]] = attrs.field(factory=dict, init=False)

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
        self.schemas[resource] = version["schema"]["openAPIV3Schema"]
        crds = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        self.objects[crds, None, crd["metadata"]["name"]] = {
            **crd,
            "metadata": {**crd["metadata"], "uid": str(uuid.uuid4()), "resourceVersion": "1"},
        }

    # --- 1, 3, 5, 6: writes -----------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> Any:
        # Discovery (/apis/GROUP/VERSION) has no plural and needs no RBAC rule.
        if request.resource is not None and request.action and request.resource.plural:
            verb = VERBS[request.action]
            agent = request.headers.get("User-Agent", "")
            group, plural = str(request.resource.group), resource_plural(request)
            selector = request.params.get("labelSelector", "")
            self.calls.append((agent, verb, group, plural, selector))
        if request.resource is None or request.action not in MUTATIONS:
            return await super()._handle(request)
        if request.action != kmock.action.CREATE and request.name is None:
            return await super()._handle(request)  # collection deletes etc.: kmock's own way
        async with self._lock:
            result = await self._mutate(request)
            self._results[request.id] = result
            meta = result.get("metadata", {})
            self.writes.append(
                (
                    request.action.value,
                    resource_plural(request),
                    meta.get("namespace"),
                    meta["name"],
                )
            )
        # Skip KubernetesEmulator._handle (its own, simpler writes); render from our result.
        return await kmock.RawHandler._handle(self, request)

    async def _serve_create(self, request: rendering.Request) -> Any:
        return self._results.pop(request.id)

    _serve_update = _serve_create
    _serve_delete = _serve_create

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _has_status(self, resource: kmock.resource) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    async def _publish(self, resource: kmock.resource, kind: str, obj: dict[str, Any]) -> None:
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self._log.append((int(obj["metadata"]["resourceVersion"]), resource, event))
        await self._buses[resource].put(event)

    def _admit(self, resource: kmock.resource, obj: dict[str, Any]) -> None:
        for policy in self.policies:
            if denial := policy(str(resource.plural), obj):
                raise kmock.KubernetesError(
                    status=422,
                    reason="Invalid",
                    message=f'admission webhook "policy.test" denied the request: {denial}',
                )
        schema = self.schemas.get(resource)
        if schema is None:
            if resource.plural in BUILTIN_VALIDATED:
                self._admit_builtin(resource, obj)
            return
        apply_defaults(schema, obj)
        prune(schema, obj)
        errors = sorted(
            jsonschema.Draft4Validator(schema).iter_errors(obj), key=lambda e: list(e.path)
        )
        if errors:
            kind = self.resources[resource].kind
            causes = "; ".join(
                f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
            )
            raise kmock.KubernetesError(
                status=422,
                reason="Invalid",
                message=f'{kind}.{resource.group} "{obj["metadata"].get("name")}" is invalid: '
                f"{causes}",
                details={"kind": kind, "name": obj["metadata"].get("name")},
            )

    def _admit_builtin(self, resource: kmock.resource, obj: dict[str, Any]) -> None:
        kind = self.resources[resource].kind
        api_version = f"{resource.group}/{resource.version}" if resource.group else "v1"
        try:
            kubernetes_validate.validate(
                {"apiVersion": api_version, "kind": kind, **obj}, K8S_VERSION, strict=True
            )
        except kubernetes_validate.ValidationError as error:
            raise kmock.KubernetesError(
                status=422,
                reason="Invalid",
                message=f'{kind} "{obj["metadata"].get("name")}" is invalid: {error.message}',
            ) from error

    async def _mutate(self, request: rendering.Request) -> dict[str, Any]:
        resource = request.resource
        assert resource is not None
        if request.action == kmock.action.CREATE:
            return await self._create(resource, request)
        key = (resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        if request.action == kmock.action.UPDATE:
            return await self._patch(resource, key, request)
        return await self._delete(resource, key)

    async def _create(self, resource: kmock.resource, request: rendering.Request) -> Any:
        obj = copy.deepcopy(request.data or {})
        meta = obj.setdefault("metadata", {})
        namespace = request.namespace or meta.get("namespace")
        name = meta.get("name") or meta.get("generateName", "obj-") + secrets.token_hex(3)
        key = (resource, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            raise kmock.KubernetesError(
                status=409, reason="AlreadyExists", message=f'"{name}" already exists'
            )
        if self._has_status(resource):
            obj.pop("status", None)
        meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if namespace is not None:
            meta["namespace"] = namespace
        self._admit(resource, obj)
        meta["resourceVersion"] = self._next_rv()
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        await self._publish(resource, "ADDED", obj)
        return obj

    async def _patch(self, resource: kmock.resource, key: Any, request: rendering.Request) -> Any:
        live = copy.deepcopy(self.objects[key].raw)
        patch = request.data
        if request.subresource == "scale":
            patch = {"spec": {"replicas": patch["spec"]["replicas"]}}
        if isinstance(patch, list):
            new = jsonpatch.apply_patch(live, patch, in_place=False)
        else:
            wanted_rv = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted_rv and wanted_rv != live["metadata"]["resourceVersion"]:
                raise kmock.KubernetesError(
                    status=409,
                    reason="Conflict",
                    message="the object has been modified; please apply your changes to the "
                    "latest version and try again",
                )
            if request.subresource == "status":
                patch = {"status": patch.get("status")}
            elif self._has_status(resource):
                patch = {key: value for key, value in patch.items() if key != "status"}
            new = dict(dicts.merge_patch_dict(live, patch))
        meta = new.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "name", "namespace", "generation"):
            if field in live["metadata"]:
                meta[field] = live["metadata"][field]
        meta["resourceVersion"] = live["metadata"]["resourceVersion"]
        if _essence(new) != _essence(live):
            meta["generation"] = int(live["metadata"].get("generation", 1)) + 1
        self._admit(resource, new)
        if new == live:
            return live  # a no-op write changes nothing, not even the resourceVersion
        meta["resourceVersion"] = self._next_rv()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(resource, key, new)
            return new
        self.objects[key].create(new)
        await self._publish(resource, "MODIFIED", new)
        return new

    async def _delete(self, resource: kmock.resource, key: Any) -> Any:
        live = copy.deepcopy(self.objects[key].raw)
        meta = live["metadata"]
        if meta.get("deletionTimestamp"):
            return live
        if meta.get("finalizers"):
            meta.update(deletionTimestamp=_now(), resourceVersion=self._next_rv())
            self.objects[key].create(live)
            await self._publish(resource, "MODIFIED", live)
            return live
        meta["resourceVersion"] = self._next_rv()
        await self._remove(resource, key, live)
        return live

    async def _remove(self, resource: kmock.resource, key: Any, last: dict[str, Any]) -> None:
        self.objects[key].delete()
        await self._publish(resource, "DELETED", last)
        # 6. The garbage collector (background propagation): dependents go after their owner.
        uid = last["metadata"].get("uid")
        dependents = [
            (dep_key, obj.raw)
            for dep_key, obj in self.objects.items()
            if not obj.deleted
            and any(ref.get("uid") == uid for ref in obj.raw["metadata"].get("ownerReferences", []))
        ]
        for dep_key, _ in dependents:
            if not self.objects[dep_key].deleted:
                await self._delete(dep_key[0], dep_key)

    # --- 2, 4: reads --------------------------------------------------------------------------

    def _matches(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        namespace = obj.get("metadata", {}).get("namespace")
        labels = obj.get("metadata", {}).get("labels") or {}
        selector = request.params.get("labelSelector", "")
        return (request.namespace is None or namespace == request.namespace) and all(
            label_matches(term.strip(), labels) for term in selector.split(",") if term.strip()
        )

    def _current(self, request: rendering.Request) -> list[dict[str, Any]]:
        return [
            obj.raw
            for (resource, _, _), obj in self.objects.items()
            if resource == request.resource and not obj.deleted and self._matches(request, obj.raw)
        ]

    async def _serve_list(self, request: rendering.Request) -> Any:
        resource = request.resource
        if resource is None or resource not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = copy.deepcopy(self._current(request))
            rv = str(self._rv)
        api_version = f"{resource.group}/{resource.version}" if resource.group else "v1"
        return {
            "apiVersion": api_version,
            "kind": f"{self.resources[resource].kind}List",
            "metadata": {"resourceVersion": rv},
            "items": items,
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now, even if no event comes
        resource = request.resource
        assert resource is not None
        bus = self._buses[resource]
        since = request.params.get("resourceVersion")
        async with self._lock:  # every write holds this lock: the replay and the bus line up
            mark = await bus.mark()
            if since:
                self.num_resumed_watches += 1
                replay = [
                    copy.deepcopy(event)
                    for rv, res, event in self._log
                    if rv > int(since)
                    and res == resource
                    and self._matches(request, event["object"])
                ]
            else:
                replay = [
                    {"type": "ADDED", "object": obj}
                    for obj in copy.deepcopy(self._current(request))
                ]
        # 2. A server-side timeout ends the stream, so clients reconnect and resume from their
        # last resourceVersion, as they do against a real API server every few minutes.
        timeout = float(request.params.get("timeoutSeconds", 0)) or None
        try:
            async with asyncio.timeout(timeout):
                for event in replay:
                    yield event
                async for event in bus.stream(since=mark):
                    if self._matches(request, event["object"]):
                        yield event
        except TimeoutError:
            return
        finally:
            await bus.unmark(mark)
