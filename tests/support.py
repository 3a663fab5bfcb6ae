"""Helpers shared by the test suites: free ports, real redis-server processes, bounded waits."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from slotserve.local.processes import http_ready, redis_ready
from slotserve.local.stack import RedisPlan, redis_argv

__all__ = ["RedisServer", "free_port", "http_ok", "wait_until"]


# Each pytest-xdist worker hands out ports from its own block below the kernel's ephemeral range
# (32768 and up on Linux): the OS's "bind port 0" choice could give two workers the same port
# between one closing its probe socket and its server binding, and outgoing connections take
# ephemeral ports too. Blocks of 1,000 from 20,000 leave room for 12 workers.
_PORT_BASE = 20_000
_PORT_BLOCK = 1_000


def _worker_index() -> int:
    # SLOTSERVE_TEST_WORKER: a session outside xdist beside another (make test's serial ones).
    worker = os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("SLOTSERVE_TEST_WORKER", "gw0")
    digits = worker.removeprefix("gw")
    return int(digits) % 12 if digits.isdigit() else 0


_next_port = itertools.count()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, from this test worker's own block of ports."""
    start = _PORT_BASE + _worker_index() * _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        port = start + next(_next_port) % _PORT_BLOCK
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {start}..{start + _PORT_BLOCK - 1}")


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
