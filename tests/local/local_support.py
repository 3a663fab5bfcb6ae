"""Helpers of the local-stack suite (a unique module name: tests/ has no packages)."""

from __future__ import annotations

import importlib.util
import time

import psutil


def stack_missing() -> str | None:
    """Why `slotserve up` cannot run in this checkout yet (engine or gateway not landed)."""
    for module in (
        "slotserve.engine.http.server",
        "slotserve.engine.core.async_engine",
        "slotserve.gateway.cli",
    ):
        if importlib.util.find_spec(module) is None:
            return f"{module} does not exist yet: the engine and gateway must land first"
    return None


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie awaiting its parent counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def still_running(pids: list[int], grace_seconds: float = 10.0) -> list[int]:
    """The ``pids`` still running after up to ``grace_seconds``; empty once all have exited."""
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if not gone(pid)]
