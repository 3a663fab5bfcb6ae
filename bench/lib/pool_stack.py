"""A whole pool on this machine for a benchmark: real ``slotserve engine`` processes, gateway
replicas on one real redis-server, one pool file listing the engines; and what the engines
themselves report while a workload runs (their ``/metrics`` counters, their ``/load`` sampled).

Processes are started with ``bench.lib.services`` (each in a session of its own, its output in a
log file) and always stopped together.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml

from bench.lib.services import RedisServer, ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
SLOTSERVE = ROOT / ".venv" / "bin" / "slotserve"
# One Prometheus sample line: name, optional {labels}, value.
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


@dataclass(frozen=True)
class EngineSpec:
    """How each engine of the pool runs."""

    model: str  # a folder or a name the engine resolves
    served_name: str
    slots: int
    num_threads: int
    max_model_len: int
    extra_flags: tuple[str, ...] = ()


@dataclass
class PoolStack:
    """Engines and gateway replicas of one pool, on ``redis``; ``start`` and ``stop`` them."""

    redis: RedisServer
    engine: EngineSpec
    num_engines: int
    num_gateways: int
    workdir: Path
    engines: list[str] = field(default_factory=list)
    gateways: list[str] = field(default_factory=list)
    _servers: list[ServerProcess] = field(default_factory=list)

    def start(self, routing: dict[str, Any] | None, label: str) -> None:
        """Start the engines (in parallel), then the gateways on a pool file whose ``routing``
        block is ``routing`` (left out when None); Redis is flushed first, so nothing a
        previous run left (queues, leases, a prefix index) is seen."""
        redis.Redis.from_url(self.redis.url).flushall()
        ports = [free_port() for _ in range(self.num_engines)]
        servers = [self._engine_server(port, f"{label}-engine{i}") for i, port in enumerate(ports)]
        self._servers += servers
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        with ThreadPoolExecutor(len(servers)) as pool:
            starts = [
                pool.submit(server.start, f"{url}/ready", 600)
                for server, url in zip(servers, urls, strict=True)
            ]
            for start in starts:
                start.result()
        self.engines = urls
        pool_entry: dict[str, Any] = {
            "model": self.engine.served_name,
            "endpoints": urls,
            # A backlog (chat-wide: 36 conversations on 12 slots) waits minutes on 2 cores; a
            # refusal would end its conversation and skew the comparison, so none times out.
            "admission": {"maxQueueSize": 10_000, "queueTimeoutSeconds": 3600},
        }
        if routing is not None:
            pool_entry["routing"] = routing
        pool_file = self.workdir / f"{label}-pools.yaml"
        pool_file.write_text(yaml.safe_dump({"pools": [pool_entry]}))
        self.gateways = []
        for i in range(self.num_gateways):
            port = free_port()
            argv = [str(SLOTSERVE), "gateway", "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--config", str(pool_file), "--redis-url", self.redis.url]
            argv += ["--log-level", "WARNING"]
            server = ServerProcess(argv, dict(os.environ), self.workdir / f"{label}-gw{i}.log")
            self._servers.append(server)
            server.start(f"http://127.0.0.1:{port}/ready", 60)
            self.gateways.append(f"http://127.0.0.1:{port}")
        time.sleep(2.0)  # every replica has polled every engine's /load once

    def _engine_server(self, port: int, label: str) -> ServerProcess:
        spec = self.engine
        argv = [str(SLOTSERVE), "engine", "--model", spec.model]
        argv += ["--served-model-name", spec.served_name, "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--max-batch-size", str(spec.slots)]
        argv += ["--num-threads", str(spec.num_threads), "--max-model-len", str(spec.max_model_len)]
        argv += ["--log-level", "WARNING", *spec.extra_flags]
        return ServerProcess(argv, dict(os.environ), self.workdir / f"{label}.log")

    def stop(self) -> None:
        for server in reversed(self._servers):
            server.stop()
        self._servers.clear()
        self.engines, self.gateways = [], []


def parse_counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The sum over labels of each metric in ``names`` in a Prometheus text page (a counter's
    ``_total`` sample counts under its family's name); 0 for one absent."""
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None:
            continue
        name = match.group(1).removesuffix("_total")
        if name in sums:
            sums[name] += float(match.group(3))
    return sums


async def scrape(engines: list[str], names: tuple[str, ...]) -> list[dict[str, float]]:
    """Each engine's counters in ``names`` now (bounded: 30 s)."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(url: str) -> dict[str, float]:
            async with session.get(f"{url}/metrics") as resp:
                resp.raise_for_status()
                return parse_counters(await resp.text(), names)

        return list(await asyncio.gather(*(one(url) for url in engines)))


@dataclass
class LoadSampler:
    """Polls each engine's ``/load`` every ``interval_s`` until stopped: the most requests each
    ran at once (``running``) and the most slots held (total - free), against its slots."""

    engines: list[str]
    interval_s: float = 0.05
    max_running: list[int] = field(default_factory=list)
    max_held: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    samples: int = 0
    failures: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        count = len(self.engines)
        self.max_running, self.max_held, self.slots = [0] * count, [0] * count, [0] * count
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                await asyncio.gather(*(self._poll(session, i) for i in range(count)))
                self.samples += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)

    async def _poll(self, session: aiohttp.ClientSession, index: int) -> None:
        try:
            async with session.get(f"{self.engines[index]}/load") as resp:
                load = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.failures += 1
            return
        self.slots[index] = int(load["slots_total"])
        self.max_running[index] = max(self.max_running[index], int(load["running"]))
        held = int(load["slots_total"]) - int(load["slots_free"])
        self.max_held[index] = max(self.max_held[index], held)
