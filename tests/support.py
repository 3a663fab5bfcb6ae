"""Helpers shared by the test suites: free ports, real redis-server processes, bounded waits."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from slotserve.local.processes import http_ready, redis_ready
from slotserve.local.stack import RedisPlan, free_port, redis_argv

__all__ = ["RedisServer", "free_port", "http_ok", "wait_until"]


def wait_until(predicate: object, timeout: float, interval: float = 0.05, what: str = "") -> None:
    """Poll ``predicate()`` until it is truthy; raise TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")


def http_ok(url: str) -> bool:
    """Whether ``GET url`` answers 2xx right now."""
    return http_ready(url)()


class RedisServer:
    """A real redis-server on a free port, with no persistence; can be stopped and restarted."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        plan = RedisPlan(mode="spawn", port=self.port, binary=self.binary)
        self.proc = subprocess.Popen(
            redis_argv(plan, self.workdir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(redis_ready(self.port), timeout=10, what=f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
