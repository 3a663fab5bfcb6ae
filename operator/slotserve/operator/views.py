"""What the operator keeps in memory about pools, and the status writes that follow from it.

``PoolView`` is the pool index's value (kopf indexes, fed by the watch); ``StatusWriter``
recomputes a pool's status from the indexes with ``status.compute_status`` and patches it only
when it changed, one pool at a time (handlers run in threads).
"""

from __future__ import annotations

import datetime
import json
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from slotserve.operator import kube
from slotserve.operator.admission import Saturation, saturated_condition
from slotserve.operator.models import API_VERSION, InferencePool
from slotserve.operator.policy import ModelClaim
from slotserve.operator.status import DeploymentView, PodView, Problem, compute_status

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
    claim: ModelClaim | None  # the model name it serves; None without one

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PoolView:
        metadata = body["metadata"]
        try:
            pool, problem = validate_pool(body), None
        except InvalidPoolError as error:
            pool, problem = None, error.problem
        spec = body.get("spec") or {}
        replicas = spec.get("replicas", 1)
        model = (spec.get("model") or {}).get("name")
        claim = (
            ModelClaim(
                namespace=metadata.get("namespace") or "default",
                name=metadata["name"],
                model=model,
                created=str(metadata.get("creationTimestamp") or ""),
            )
            if isinstance(model, str) and model
            else None
        )
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
            claim=claim,
        )


def api_message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except ValueError:
        return str(error.reason)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def first(index: kopf.Index[Key, Any], key: Key) -> Any:
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
    # Published by the admission monitor; written with the rest of the status.
    admission: dict[Key, dict[str, Any]] = field(default_factory=dict)
    saturation: dict[Key, Saturation] = field(default_factory=dict)
    num_status_writes: int = 0
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
            view: PoolView | None = first(pool_index, key)
            if view is None:  # deleted: nothing to write to
                self.forget(key)
                return
            written = self._written.get(key)
            previous = written.status if written and written.uid == view.uid else view.status
            status = compute_status(
                pool_name=key[1],
                desired_replicas=view.desired_replicas,
                deployment=first(deployment_index, key),
                pods=pod_index.get(key, []),
                problem=view.problem or self.problems.get(key),
                previous_conditions=previous.get("conditions") or [],
                now=_now(),
            )
            if observed_generation is not None:
                status["observedGeneration"] = observed_generation
            saturation = self.saturation.get(key)
            if saturation is not None:
                before = {c.get("type"): c for c in previous.get("conditions") or []}
                status["conditions"].append(
                    saturated_condition(saturation, before.get("Saturated"), _now())
                )
            admission = self.admission.get(key)
            if admission is not None:
                status["admission"] = admission
            if kube.is_subset(status, previous) and (
                admission is None or previous.get("admission") == admission
            ):
                return
            patch = dict(status)
            if admission is not None:  # reasons no longer seen are removed, not merged
                patch["admission"] = kube.replacing_patch(previous.get("admission"), admission)
            try:
                self.children.patch_pool_status(key[0], key[1], patch)
                self.num_status_writes += 1
            except ApiException as error:
                if error.status == 404:  # deleted meanwhile
                    self.forget(key)
                    return
                raise
            self._written[key] = _Written(view.uid, {**previous, **status})

    def forget(self, key: Key) -> None:
        self._written.pop(key, None)
        self.problems.pop(key, None)
        self.admission.pop(key, None)
        self.saturation.pop(key, None)


def all_views(pool_index: kopf.Index[Key, PoolView]) -> Iterator[PoolView]:
    """Every pool the operator watches (one view per key)."""
    for key in list(pool_index):
        view = first(pool_index, key)
        if view is not None:
            yield view
