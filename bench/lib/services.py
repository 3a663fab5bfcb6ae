"""Local services a benchmark starts: a redis-server and HTTP processes, waited for within a
bound. Built on the local stack's own pieces (``slotserve.local``), not on the test suite's."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from slotserve.local.processes import http_ready, redis_ready
from slotserve.local.stack import RedisPlan, free_port, redis_argv

__all__ = ["RedisServer", "free_port", "http_ok", "wait_until"]


def wait_until(predicate: Callable[[], object], timeout: float, what: str = "") -> None:
    """Poll ``predicate()`` until it is truthy; raise TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")


def http_ok(url: str) -> bool:
    """Whether ``GET url`` answers 2xx right now."""
    return http_ready(url)()


class RedisServer:
    """A redis-server on a free port with no persistence, in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.plan = RedisPlan(mode="spawn", port=free_port(), binary=binary)
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.plan.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            redis_argv(self.plan, self.workdir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port = self.plan.port or 0
        wait_until(redis_ready(port), timeout=10, what=f"redis-server on port {port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
