"""What the operator keeps in memory about pools: the pool index's values.

``PoolView`` is the pool index's value (kopf indexes, fed by the watch): the parsed pool or why
it cannot run, its model-name claim, and the owner reference its children get. Pure: nothing
here talks to the API.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from pydantic import ValidationError

from slotserve.contracts.crd import API_VERSION
from slotserve.operator.models import InferencePool
from slotserve.operator.policy import ModelClaim
from slotserve.operator.status import Problem

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
    owner: kopf.Body  # what its children's owner references and its events name
    status: dict[str, Any]
    pool: InferencePool | None
    problem: Problem | None
    claim: ModelClaim | None  # the model name it serves; None without one

    @property
    def key(self) -> Key:
        return (self.owner["metadata"]["namespace"], self.owner["metadata"]["name"])

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
            owner=kopf.Body(
                {
                    "apiVersion": body.get("apiVersion", API_VERSION),
                    "kind": body.get("kind", "InferencePool"),
                    "metadata": {
                        "name": metadata["name"],
                        "namespace": metadata.get("namespace"),
                        "uid": metadata.get("uid", ""),
                    },
                }
            ),
            status=dict(body.get("status") or {}),
            pool=pool,
            problem=problem,
            claim=claim,
        )


def first(index: kopf.Index[Key, Any], key: Key) -> Any:
    """The index's value for ``key`` (one per key here), or None."""
    return next(iter(index.get(key, [])), None)


def all_views(pool_index: kopf.Index[Key, PoolView]) -> Iterator[PoolView]:
    """Every pool the operator watches (one view per key)."""
    for key in list(pool_index):
        view = first(pool_index, key)
        if view is not None:
            yield view
