"""Gateway test helpers: engine doubles and gateway replicas as real processes on free ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import yaml

from tests.engine_forkserver import ForkedProcess, start_engine
from tests.support import free_port, http_ok, wait_until

ROOT = Path(__file__).resolve().parents[2]
DOUBLE = Path(__file__).with_name("gateway_engine_double.py")
SLOTSERVE = ROOT / ".venv" / "bin" / "slotserve"


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes] | ForkedProcess
    url: str
    log: Path

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Double(Proc):
    def stats(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=5) as resp:
            return json.loads(resp.read())

    def control(self, **body) -> None:
        req = urllib.request.Request(
            f"{self.url}/control",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=5).read()


ProcT = TypeVar("ProcT", bound=Proc)


class Spawner:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[Proc] = []

    def _start(
        self, cls: type[ProcT], name: str, argv: list[str], port: int, env: dict | None = None
    ) -> ProcT:
        log = self.tmp_path / f"{name}-{port}.log"
        full_env = {**os.environ, **(env or {})}
        popen = start_engine(argv, log, full_env)  # runs anything that is not an engine as is
        proc = cls(name, popen, f"http://127.0.0.1:{port}", log)
        self.procs.append(proc)
        return proc

    def double(self, slots: int = 2, delay: float = 0.05, model: str = "double") -> Double:
        port = free_port()
        argv = [sys.executable, str(DOUBLE), "--port", str(port), "--slots", str(slots)]
        argv += ["--delay", str(delay), "--model", model]
        proc = self._start(Double, "double", argv, port)
        wait_until(lambda: http_ok(f"{proc.url}/health"), 15, what="engine double")
        return proc

    def gateway(
        self,
        pool_file: Path,
        redis_url: str | None = None,
        lease_ttl: float = 2.0,
        extra: list[str] | None = None,
        wait: bool = True,
    ) -> Proc:
        port = free_port()
        argv = [str(SLOTSERVE), "gateway", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--config", str(pool_file), "--log-level", "WARNING", *(extra or [])]
        if redis_url:
            argv += ["--redis-url", redis_url]
        env = {"SLOTSERVE_GATEWAY_LEASE_TTL_SECONDS": str(lease_ttl)}
        proc = self._start(Proc, "gateway", argv, port, env)
        if wait:
            try:
                wait_until(lambda: http_ok(f"{proc.url}/ready"), 20, what="gateway /ready")
            except TimeoutError:
                raise AssertionError(f"gateway did not start:\n{proc.logs()}") from None
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.kill(signal.SIGTERM if proc.name == "gateway" else signal.SIGKILL)


def write_pools(path: Path, pools: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"pools": pools}))
    return path


def pool(model: str, endpoints: list[str], **admission) -> dict:
    return {
        "model": model,
        "endpoints": endpoints,
        "batching": {"policy": "continuous", "maxBatchSize": 2},
        "admission": {"maxQueueSize": 256, "queueTimeoutSeconds": 30, **admission},
    }
