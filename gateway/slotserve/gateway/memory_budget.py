"""A replica's budget for the bytes its requests hold while they wait and while they stream.

Every request reserves its body (``Content-Length``, else the largest body allowed) plus a fixed
overhead before its body is read, resizes that to the body it got, and grows it while its answer
is buffered (a stream's pending event, a whole answer); past the budget the request gets 503 with
``Retry-After`` (or its stream ends with an error event), never an OOM-kill that would cut every
stream of every pool on the replica.

The default budget is a share of the memory the container may still use at start, read as the
engine sizes its KV cache (``engine/core/memory.py``): the node's ``MemAvailable`` capped by every
cgroup limit above the process (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) minus that
cgroup's working set (usage less inactive file pages, what the kubelet compares with the limit).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

# aiohttp's request, transport and task, the handler's frames, admission's waiter: measured at
# ~25 KiB a held request; counted generously.
REQUEST_OVERHEAD_BYTES = 64 * 1024
UNLIMITED_BYTES = 1 << 60  # cgroup v1's "no limit" is 2^63 - 1 rounded down to a page


@dataclass(frozen=True)
class MemorySources:
    """Where memory figures are read; tests point these at fake files."""

    cgroup_root: Path = Path("/sys/fs/cgroup")
    proc_self_cgroup: Path = Path("/proc/self/cgroup")
    meminfo: Path = Path("/proc/meminfo")


def available_memory_bytes(sources: MemorySources = MemorySources()) -> int:
    """Bytes this process can still use: MemAvailable, capped by every cgroup's headroom."""
    return min([_mem_available(sources.meminfo), *_cgroup_headrooms(sources)])


def default_budget_bytes(fraction: float, sources: MemorySources = MemorySources()) -> int:
    return max(REQUEST_OVERHEAD_BYTES, int(available_memory_bytes(sources) * fraction))


def _mem_available(meminfo: Path) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_headrooms(sources: MemorySources) -> Iterator[int]:
    try:
        lines = sources.proc_self_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2
            files = ("memory.max", "memory.current", "inactive_file")
            yield from _headrooms(sources.cgroup_root, path, *files)
        elif "memory" in controllers.split(","):  # v1
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            yield from _headrooms(sources.cgroup_root / "memory", path, *files)


def _headrooms(
    mount: Path, path: str, limit_file: str, usage_file: str, inactive: str
) -> Iterator[int]:
    if not mount.is_dir():
        return
    # Inside a container its own cgroup is mounted as the root: start from the deepest that is.
    directory = mount / path.lstrip("/")
    while not directory.is_dir() and directory != mount:
        directory = directory.parent
    while True:
        limit = _read_int(directory / limit_file)
        if limit is not None and limit < UNLIMITED_BYTES:
            usage = _read_int(directory / usage_file) or 0
            yield max(0, limit - max(0, usage - _stat_value(directory / "memory.stat", inactive)))
        if directory == mount or directory.parent == directory:
            return
        directory = directory.parent


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


class MemoryBudget:
    """Bytes held by this replica's requests, against a limit."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def reserve(self, num_bytes: int) -> Reservation | None:
        """A reservation of ``num_bytes``, or None when they do not fit now."""
        if self.held_bytes + num_bytes > self.limit_bytes:
            return None
        self.held_bytes += num_bytes
        return Reservation(self, num_bytes)


class Reservation:
    """What one request holds; ``resize`` may fail to grow, never to shrink."""

    def __init__(self, budget: MemoryBudget, num_bytes: int) -> None:
        self.budget = budget
        self.num_bytes = num_bytes

    def resize(self, num_bytes: int) -> bool:
        growth = num_bytes - self.num_bytes
        if growth > 0 and self.budget.held_bytes + growth > self.budget.limit_bytes:
            return False
        self.budget.held_bytes += growth
        self.num_bytes = num_bytes
        return True

    def release(self) -> None:
        self.budget.held_bytes -= self.num_bytes
        self.num_bytes = 0


# A request's Reservation, set by request_limits.py for every POST that matched a route.
RESERVATION = web.RequestKey("reservation", Reservation)


def request_reservation(request: web.Request) -> Reservation | None:
    """The bytes a request holds in the budget (None: the middleware did not run for it)."""
    return request.get(RESERVATION)
