"""Pools: what the gateway serves. Loaded from a YAML file (reloaded when it changes) or from
Kubernetes (``discovery.py``); both end up in one ``PoolRegistry``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator

from slotserve.contracts.pool_spec import AdmissionSpec, BatchingSpec, RoutingSpec, WireModel
from slotserve.gateway.admission.types import PoolPolicy

log = logging.getLogger(__name__)


class PoolConfig(WireModel):
    """One pool in the YAML file (camelCase keys)."""

    model: str = Field(min_length=1, max_length=256)
    endpoints: list[str] = Field(default_factory=list)
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    admission: AdmissionSpec = Field(default_factory=AdmissionSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    # Seconds an engine of this pool takes to start: the Retry-After of a request held while
    # none is up (unset: the gateway's cold_start_seconds).
    cold_start_seconds: float | None = Field(default=None, gt=0, le=86_400)

    @field_validator("endpoints")
    @classmethod
    def _http_urls(cls, endpoints: list[str]) -> list[str]:
        cleaned = []
        for url in endpoints:
            parts = urlsplit(url)
            if parts.scheme not in {"http", "https"} or not parts.netloc:
                raise ValueError(f"endpoint {url!r} must be an http(s)://host:port URL")
            cleaned.append(url.rstrip("/"))
        return cleaned


class PoolsFile(WireModel):
    pools: list[PoolConfig] = Field(default_factory=list)

    @field_validator("pools")
    @classmethod
    def _unique_models(cls, pools: list[PoolConfig]) -> list[PoolConfig]:
        names = [pool.model for pool in pools]
        if len(names) != len(set(names)):
            raise ValueError("two pools serve the same model name")
        return pools


@dataclass(frozen=True)
class Pool:
    """A model name, its engine endpoints and its batching and admission policy."""

    model: str
    endpoints: tuple[str, ...]
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    admission: AdmissionSpec = field(default_factory=AdmissionSpec)
    cold_start_s: float | None = None  # measured (status.coldStartSeconds) or configured
    routing: RoutingSpec = field(default_factory=RoutingSpec)

    @property
    def policy(self) -> PoolPolicy:
        return PoolPolicy.from_specs(self.model, self.admission)


class PoolConfigError(Exception):
    """The pool file cannot be read or is invalid; the message says where."""


def parse_pools(text: str, source: str = "pool file") -> list[Pool]:
    """Parse a pool file's text; raises PoolConfigError with a readable message."""
    try:
        raw = yaml.safe_load(text) or {}
        parsed = PoolsFile.model_validate(raw)
    except yaml.YAMLError as exc:
        raise PoolConfigError(f"{source}: not valid YAML: {exc}") from exc
    except ValidationError as exc:
        raise PoolConfigError(f"{source}: {exc}") from exc
    return [
        Pool(p.model, tuple(p.endpoints), p.batching, p.admission, p.cold_start_seconds, p.routing)
        for p in parsed.pools
    ]


def load_pools(path: Path) -> list[Pool]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise PoolConfigError(f"cannot read pool file {path}: {exc}") from exc
    return parse_pools(text, str(path))


class PoolRegistry:
    """The pools the gateway serves now, by model name.

    ``version`` counts changes; ``synced_version`` is the version once the first full list of
    pools (the file, or every watched namespace) was in, so readiness can wait for it: a replica
    that answered before would send 404 for models it simply has not heard of yet.
    """

    def __init__(self, pools: Iterable[Pool] = ()) -> None:
        self.pools: dict[str, Pool] = {}
        self.version = 0
        self.synced_version: int | None = None
        self.replace(pools)

    def replace(self, pools: Iterable[Pool]) -> None:
        self.pools = {pool.model: pool for pool in pools}
        self.version += 1

    def mark_synced(self) -> None:
        if self.synced_version is None:
            self.synced_version = self.version

    def get(self, model: str) -> Pool | None:
        return self.pools.get(model)

    def policies(self) -> list[PoolPolicy]:
        return [pool.policy for pool in self.pools.values()]

    def endpoints(self) -> set[str]:
        return {url for pool in self.pools.values() for url in pool.endpoints}


async def watch_pool_file(path: Path, registry: PoolRegistry, interval_s: float = 1.0) -> None:
    """Reload ``path`` into ``registry`` whenever its mtime changes; keep the old pools on error."""
    last_mtime = path.stat().st_mtime_ns if path.exists() else 0
    while True:
        await asyncio.sleep(interval_s)
        with contextlib.suppress(OSError):
            mtime = path.stat().st_mtime_ns
            if mtime == last_mtime:
                continue
            last_mtime = mtime
            try:
                registry.replace(load_pools(path))
                log.info("reloaded %s: %d pools", path, len(registry.pools))
            except PoolConfigError as exc:
                log.error("keeping the previous pools: %s", exc)
