"""Local services a benchmark starts: a redis-server and HTTP processes, waited for within a
bound. Built on the local stack's own pieces (``slotserve.local``), not on the test suite's."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from slotserve.local.processes import http_ready, redis_ready
from slotserve.local.stack import RedisPlan, free_port, redis_argv

__all__ = ["RedisServer", "ServerProcess", "free_port", "http_ok", "wait_until"]


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


class ServerProcess:
    """An HTTP server a benchmark runs in a session of its own (the server and any workers it
    spawns, stopped together), its output in ``log_path``."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = 0.0
        self.pid = 0  # the server's, once started; also its session's and process group's id

    def start(self, ready_url: str, timeout: float) -> None:
        """Start the server and wait until ``GET ready_url`` answers 2xx (``startup_s``)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.pid = self.proc.pid
        ready = http_ready(ready_url)
        while not ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: see {self.log_path}")
            if time.monotonic() - started > timeout:
                self.stop()
                raise RuntimeError(f"server not ready in {timeout:.0f} s: see {self.log_path}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - started

    def stop(self, timeout: float = 30) -> None:
        """SIGINT to the server's session (a graceful stop), SIGKILL to what is left after
        ``timeout`` seconds."""
        if self.proc is None:
            return
        group = self.pid
        for sig in (signal.SIGINT, signal.SIGKILL):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        # Workers the server spawned may outlive it: end the rest of its group, and wait until
        # init has reaped them, so the next server starts on a machine they have left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not group_alive(group), timeout=10, what=f"process group {group}")


def group_alive(group: int) -> bool:
    """Whether any process (a zombie included) is left in process group ``group``."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
