"""kopf handlers: one level-based reconcile per pool, status kept current from watched children.

- ``reconcile`` runs on create, update and resume: validate, build the children with the pure
  builders, adopt them (owner references) and create-or-patch them. Invalid specs that the schema
  cannot catch become a permanent error, a Degraded condition and a Warning Event; a child name
  taken by someone else and write conflicts are retried.
- Pods and Deployments of pools are watched (kopf indexes, no polling); every change recomputes
  the pool's status with ``status.compute_status`` and writes it when it differs.
- A child deleted by hand is re-created while its pool exists; deleting the pool deletes the
  children through their owner references (the garbage collector; no finalizer needed).
"""

from __future__ import annotations

import datetime
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
import kubernetes.client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from slotserve.operator import builders, kube
from slotserve.operator.models import API_VERSION, GROUP, PLURAL, VERSION, InferencePool
from slotserve.operator.settings import OperatorSettings
from slotserve.operator.status import DeploymentView, PodView, Problem, compute_status

POOLS = (GROUP, VERSION, PLURAL)
# Fully qualified: a bare "pods" also matches metrics.k8s.io's PodMetrics.
DEPLOYMENTS = ("apps", "v1", "deployments")
PODS = ("v1", "pods")
SERVICES = ("v1", "services")
CHILD_LABELS = {
    builders.POOL_LABEL: kopf.PRESENT,
    "app.kubernetes.io/managed-by": builders.MANAGED_BY,
}
# The pool name becomes a Service name and a label value: a DNS-1035 label of <= 63 characters.
# CR names may be any DNS subdomain (dots, leading digits, 253 characters), so check it here.
_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

Key = tuple[str, str]  # (namespace, pool name)


class InvalidPoolError(Exception):
    """A pool the schema accepted but the operator cannot run."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.problem = Problem(reason, message)


def validate_pool(body: Mapping[str, Any]) -> InferencePool:
    """Parse and check a pool; raises InvalidPoolError with a condition reason."""
    name = body["metadata"]["name"]
    if len(name) > 63 or not _SERVICE_NAME.match(name):
        raise InvalidPoolError(
            "InvalidName",
            f"pool name {name!r} must be a DNS-1035 label (a-z, 0-9, '-', starting with a "
            "letter, at most 63 characters): it names the engine Service",
        )
    try:
        return InferencePool.from_body(body)
    except ValidationError as error:
        details = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in error.errors()
        )
        raise InvalidPoolError("InvalidSpec", f"invalid spec: {details}") from error


@dataclass(frozen=True)
class PoolView:
    """What the operator keeps in memory about one pool (the pool index's value)."""

    uid: str
    generation: int
    desired_replicas: int
    owner: dict[str, Any]
    status: dict[str, Any]
    pool: InferencePool | None
    problem: Problem | None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PoolView:
        metadata = body["metadata"]
        try:
            pool, problem = validate_pool(body), None
        except InvalidPoolError as error:
            pool, problem = None, error.problem
        replicas = (body.get("spec") or {}).get("replicas", 1)
        return cls(
            uid=metadata.get("uid", ""),
            generation=int(metadata.get("generation", 1)),
            desired_replicas=replicas if isinstance(replicas, int) else 1,
            owner={
                "apiVersion": body.get("apiVersion", API_VERSION),
                "kind": body.get("kind", "InferencePool"),
                "metadata": {
                    "name": metadata["name"],
                    "namespace": metadata.get("namespace"),
                    "uid": metadata.get("uid", ""),
                },
            },
            status=dict(body.get("status") or {}),
            pool=pool,
            problem=problem,
        )


def _api_message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except ValueError:
        return str(error.reason)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _first(index: kopf.Index[Key, Any], key: Key) -> Any:
    return next(iter(index.get(key, [])), None)


@dataclass
class _Written:
    uid: str
    status: dict[str, Any]


@dataclass
class StatusWriter:
    """Writes pool status, once per change, serialised per pool (handlers run in threads)."""

    children: kube.Children
    problems: dict[Key, Problem] = field(default_factory=dict)
    _written: dict[Key, _Written] = field(default_factory=dict)
    _locks: dict[Key, threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def refresh(
        self,
        key: Key,
        *,
        pool_index: kopf.Index[Key, PoolView],
        pod_index: kopf.Index[Key, PodView],
        deployment_index: kopf.Index[Key, DeploymentView],
        observed_generation: int | None = None,
    ) -> None:
        """Recompute the status of pool ``key`` from the indexes; patch it if it changed."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            view: PoolView | None = _first(pool_index, key)
            if view is None:  # deleted: nothing to write to
                self.forget(key)
                return
            written = self._written.get(key)
            previous = written.status if written and written.uid == view.uid else view.status
            status = compute_status(
                pool_name=key[1],
                desired_replicas=view.desired_replicas,
                deployment=_first(deployment_index, key),
                pods=pod_index.get(key, []),
                problem=view.problem or self.problems.get(key),
                previous_conditions=previous.get("conditions") or [],
                now=_now(),
            )
            if observed_generation is not None:
                status["observedGeneration"] = observed_generation
            if kube.is_subset(status, previous):
                return
            try:
                self.children.patch_pool_status(key[0], key[1], status)
            except ApiException as error:
                if error.status == 404:  # deleted meanwhile
                    self.forget(key)
                    return
                raise
            self._written[key] = _Written(view.uid, {**previous, **status})

    def forget(self, key: Key) -> None:
        self._written.pop(key, None)
        self.problems.pop(key, None)


class PoolOperator:
    """The handlers of one operator process, registered on their own kopf registry."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        self._writer: StatusWriter | None = None

    @property
    def writer(self) -> StatusWriter:
        if self._writer is None:
            raise RuntimeError("the operator has not started (no API client yet)")
        return self._writer

    def build_registry(self) -> kopf.OperatorRegistry:
        """A registry with every handler of this operator (no module-level global state)."""
        registry = kopf.OperatorRegistry()
        # Explicit ids: kopf would name methods "PoolOperator.x"; index ids become kwarg names.
        kopf.on.login(registry=registry, id="login")(self.login)
        kopf.on.startup(registry=registry, id="startup")(self.startup)
        kopf.index(*POOLS, registry=registry, id="pool_index")(self.pool_index)
        kopf.index(*PODS, labels=CHILD_LABELS, registry=registry, id="pod_index")(self.pod_index)
        kopf.index(*DEPLOYMENTS, labels=CHILD_LABELS, registry=registry, id="deployment_index")(
            self.deployment_index
        )
        for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
            on(*POOLS, registry=registry, id="reconcile")(self.reconcile)
        kopf.on.event(*POOLS, registry=registry, id="pool_event")(self.pool_event)
        for resource in (PODS, DEPLOYMENTS, SERVICES):
            kopf.on.event(*resource, labels=CHILD_LABELS, registry=registry, id="child_event")(
                self.child_event
            )
        return registry

    # --- start-up -------------------------------------------------------------------------

    def login(self, **_: Any) -> kopf.ConnectionInfo:
        return kube.connection_info(kube.load_configuration())

    def startup(self, **_: Any) -> None:
        api_client = kubernetes.client.ApiClient(kube.load_configuration())
        api_client.user_agent = kube.USER_AGENT
        self._writer = StatusWriter(kube.Children(api_client))

    # --- indexes: in-memory views fed by the watches ---------------------------------------

    def pool_index(self, body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[Key, Any]:
        return {(namespace, name): PoolView.from_body(body)}

    def pod_index(self, body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> Any:
        return {(namespace, labels[builders.POOL_LABEL]): PodView.from_body(body)}

    def deployment_index(
        self, body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any
    ) -> dict[Key, Any]:
        return {(namespace, labels[builders.POOL_LABEL]): DeploymentView.from_body(body)}

    # --- the reconcile ----------------------------------------------------------------------

    def reconcile(
        self,
        body: kopf.Body,
        namespace: str,
        name: str,
        meta: kopf.Meta,
        logger: kopf.Logger,
        **indexes: Any,
    ) -> None:
        key = (namespace, name)
        generation = int(meta.get("generation", 1))

        def report(problem: Problem) -> None:
            """Record why the pool cannot run: condition (via status) and a Warning event."""
            self.writer.problems[key] = problem
            self._refresh(key, indexes, observed_generation=generation)
            kopf.warn(body, reason=problem.reason, message=problem.message)

        try:
            outcomes = self._apply_children(validate_pool(body), body)
        except InvalidPoolError as error:
            report(error.problem)
            raise kopf.PermanentError(error.problem.message) from error
        except kube.ChildConflictError as error:
            report(Problem("ChildConflict", str(error)))
            raise kopf.TemporaryError(str(error), delay=30) from error
        except ApiException as error:
            if error.status in {400, 422}:  # the API server refused what we built from the spec
                report(Problem("ChildRejected", _api_message(error)))
                raise kopf.PermanentError(_api_message(error)) from error
            if error.status in {409, 429} or error.status >= 500:
                raise kopf.TemporaryError(f"API said {error.status}; retrying", delay=2) from error
            raise
        self.writer.problems.pop(key, None)
        logger.info(f"children: {outcomes}")
        self._refresh(key, indexes, observed_generation=generation)

    def _apply_children(self, pool: InferencePool, owner: Mapping[str, Any]) -> dict[str, str]:
        children = [
            builders.build_deployment(pool, engine_image=self.settings.engine_image),
            builders.build_service(pool),
        ]
        kopf.adopt(children, owner=dict(owner))
        uid = owner["metadata"]["uid"]
        return {
            child["kind"]: self.writer.children.apply(child, owner_uid=uid) for child in children
        }

    # --- keeping status current ---------------------------------------------------------------

    def pool_event(self, type: str | None, namespace: str, name: str, **_: Any) -> None:
        if type == "DELETED":
            self.writer.forget((namespace, name))

    def child_event(
        self,
        type: str | None,
        body: kopf.Body,
        namespace: str,
        labels: kopf.Labels,
        logger: kopf.Logger,
        **indexes: Any,
    ) -> None:
        key = (namespace, labels[builders.POOL_LABEL])
        view: PoolView | None = _first(indexes["pool_index"], key)
        if view is None:
            return
        if type == "DELETED" and body.get("kind") != "Pod" and view.pool is not None:
            self._recreate(view, logger)
        self._refresh(key, indexes)

    def _recreate(self, view: PoolView, logger: kopf.Logger) -> None:
        """Level-based: a child deleted by hand comes back while its pool exists."""
        assert view.pool is not None
        metadata = view.owner["metadata"]
        if not self.writer.children.pool_exists(metadata["namespace"], metadata["name"], view.uid):
            return  # the pool is being deleted: the garbage collector removes its children
        try:
            outcomes = self._apply_children(view.pool, view.owner)
        except (kube.ChildConflictError, ApiException) as error:
            logger.warning(f"could not re-create a deleted child: {error}")
            return
        logger.info(f"re-created deleted children: {outcomes}")

    def _refresh(
        self, key: Key, indexes: Mapping[str, Any], observed_generation: int | None = None
    ) -> None:
        self.writer.refresh(
            key,
            pool_index=indexes["pool_index"],
            pod_index=indexes["pod_index"],
            deployment_index=indexes["deployment_index"],
            observed_generation=observed_generation,
        )
