"""What ``slotserve up`` and ``slotserve demo`` start: engines per pool, Redis, one gateway.

The plan (ports, pool file, command lines) is built by pure functions so that it can be read
and tested; ``start_stack`` is the thin part that hands it to a Supervisor.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from rich.console import Console

from slotserve.contracts.engine_argv import EngineLaunch
from slotserve.contracts.engine_argv import engine_argv as contract_engine_argv
from slotserve.contracts.pool_spec import AdmissionSpec, BatchingSpec
from slotserve.contracts.weights import DType, Quantization
from slotserve.local.processes import Child, ChildSpec, Supervisor, http_ready, redis_ready

DEMO_MODEL = "smollm2"


@dataclass
class EngineOptions:
    """Engine flags shared by every engine of one pool (see slotserve/engine/settings.py)."""

    model: str
    served_model_name: str
    batching: BatchingSpec
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    num_threads: int | None = None
    dtype: DType | None = None
    quantization: Quantization | None = None
    drain_timeout_seconds: float = 5.0

    def launch(self, host: str, port: int) -> EngineLaunch:
        """One engine of the pool, listening on ``host:port``."""
        return EngineLaunch(
            model=self.model,
            served_model_name=self.served_model_name,
            batching=self.batching,
            host=host,
            port=port,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            drain_timeout_seconds=self.drain_timeout_seconds,
            kv_cache_tokens=self.kv_cache_tokens,
            num_threads=self.num_threads,
            quantization=self.quantization,
        )


@dataclass
class PoolPlan:
    """One OpenAI model name, served by ``num_engines`` identical engines."""

    engine: EngineOptions
    num_engines: int
    admission: AdmissionSpec
    engine_ports: list[int] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.engine.served_model_name

    def endpoints(self, host: str) -> list[str]:
        return [f"http://{host}:{port}" for port in self.engine_ports]


@dataclass
class RedisPlan:
    """external: use ``url``; spawn: start redis-server on ``port``; memory: no Redis."""

    mode: Literal["external", "spawn", "memory"]
    url: str | None = None
    port: int | None = None
    binary: str | None = None


@dataclass
class RunningStack:
    host: str
    gateway_url: str
    redis: RedisPlan
    pools: list[PoolPlan]
    children: list[Child]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def resolve_model_once(model: str) -> str:
    """Pull/resolve the model in the parent, so N engines do not race to download it."""
    from slotserve.models.resolve import ModelNotFoundError, resolve_model

    try:
        return str(resolve_model(model, show_progress=True))
    except ModelNotFoundError as exc:
        raise SystemExit(f"slotserve: {exc}") from None


def default_num_threads(num_busy_engines: int) -> int:
    """Torch threads per engine so that the engines working at once share the cores."""
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (num_cores or 1) // max(1, num_busy_engines))


def plan_redis(redis_url: str | None, use_redis: bool) -> RedisPlan:
    """A given URL wins; else start redis-server if it is installed; else the in-process queue."""
    if redis_url:
        return RedisPlan(mode="external", url=redis_url)
    binary = shutil.which("redis-server") if use_redis else None
    if binary is None:
        return RedisPlan(mode="memory")
    port = free_port()
    return RedisPlan(mode="spawn", url=f"redis://127.0.0.1:{port}/0", port=port, binary=binary)


def assign_ports(pools: list[PoolPlan], engine_ports: list[int] | None = None) -> None:
    """Give every engine a port: the listed ones in order, then free ones."""
    given = list(engine_ports or [])
    for pool in pools:
        pool.engine_ports = [
            given.pop(0) if given else free_port() for _ in range(pool.num_engines)
        ]


def pool_file_content(pools: list[PoolPlan], host: str) -> dict[str, object]:
    """The gateway's pool file (camelCase YAML, see the gateway contract)."""
    return {
        "pools": [
            {
                "model": pool.model,
                "endpoints": pool.endpoints(host),
                "batching": pool.engine.batching.model_dump(by_alias=True),
                "admission": pool.admission.model_dump(by_alias=True),
            }
            for pool in pools
        ]
    }


def slotserve_argv(*args: str) -> list[str]:
    """Run a slotserve subcommand with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "slotserve.cli", *args]


def engine_argv(options: EngineOptions, host: str, port: int) -> list[str]:
    return slotserve_argv(*contract_engine_argv(options.launch(host, port)))


def gateway_argv(host: str, port: int, pool_file: Path, redis_url: str | None) -> list[str]:
    argv = slotserve_argv(
        "gateway", "--host", host, "--port", str(port), "--config", str(pool_file)
    )
    if redis_url:
        argv += ["--redis-url", redis_url]
    return argv


def redis_argv(plan: RedisPlan, workdir: Path) -> list[str]:
    if plan.mode != "spawn" or plan.binary is None or plan.port is None:
        raise ValueError(f"no redis-server to start for a {plan.mode!r} Redis plan")
    return [
        plan.binary,
        "--port", str(plan.port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(workdir),
    ]  # fmt: skip


def start_stack(
    supervisor: Supervisor,
    pools: list[PoolPlan],
    *,
    host: str,
    gateway_port: int,
    redis: RedisPlan,
    run_dir: Path,
    ready_timeout_seconds: float,
) -> RunningStack:
    """Start Redis (if planned), every engine and the gateway; return once all are ready."""
    run_dir.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    if redis.mode == "spawn":
        redis_dir = run_dir / "redis"
        redis_dir.mkdir(exist_ok=True)
        argv = redis_argv(redis, redis_dir)
        spec = ChildSpec("redis-server", argv, redis_ready(redis.port or 0))
        children.append(supervisor.start(spec))
    engine_env = {"TOKENIZERS_PARALLELISM": "false"}
    for pool in pools:
        for index, port in enumerate(pool.engine_ports):
            name = f"engine {pool.model}" + (f" #{index + 1}" if pool.num_engines > 1 else "")
            spec = ChildSpec(
                name,
                engine_argv(pool.engine, host, port),
                http_ready(f"http://{host}:{port}/ready"),
                env=engine_env,
                stop_timeout_seconds=pool.engine.drain_timeout_seconds + 10,
            )
            children.append(supervisor.start(spec))
    pool_file = run_dir / "pools.yaml"
    pool_file.write_text(yaml.safe_dump(pool_file_content(pools, host), sort_keys=False))
    gateway_spec = ChildSpec(
        "gateway",
        gateway_argv(host, gateway_port, pool_file, redis.url),
        gateway_ready(
            f"http://{host}:{gateway_port}/ready",
            {pool.model: pool.num_engines for pool in pools},
        ),
    )
    children.append(supervisor.start(gateway_spec))
    supervisor.wait_ready(children, timeout_seconds=ready_timeout_seconds)
    return RunningStack(
        host=host,
        gateway_url=f"http://{host}:{gateway_port}",
        redis=redis,
        pools=pools,
        children=children,
    )


def gateway_ready(url: str, num_engines: dict[str, int]) -> Callable[[], bool]:
    """A probe that is true once the gateway is ready and sees every engine of every pool.

    The gateway answers /ready after its first round of engine checks, which may come before
    the engines finished loading; a request sent then would get "no engine is ready".
    """

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if not 200 <= resp.status < 300:
                    return False
                pools = json.loads(resp.read()).get("pools", {})
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return all(
            pools.get(model, {}).get("usable_endpoints", 0) >= count
            for model, count in num_engines.items()
        )

    return probe


def describe_redis(redis: RedisPlan) -> str:
    if redis.mode == "external":
        return f"Redis at {redis.url}"
    if redis.mode == "spawn":
        return f"Redis started on port {redis.port}"
    return "in-process admission (no Redis)"


def print_children(console: Console, children: list[Child]) -> None:
    for child in children:
        console.print(f"  [dim]{child.name:<24} pid {child.pid:<8} log {child.log_path}")
