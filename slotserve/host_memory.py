"""How much memory this process can still use, read as the kubelet sees it (pure; no torch).

A process in a container can use the smaller of what the node has available (``MemAvailable``)
and what its cgroup allows: ``memory.max`` (cgroup v2) or ``memory.limit_in_bytes`` (v1), minus
the cgroup's working set (usage less inactive file pages: the figure the kubelet compares with
the limit). Sizing by ``MemAvailable`` alone is what gets a pod OOM-killed. Every cgroup from
the process's own up to the root is checked, since a limit may sit on an ancestor. The engine
sizes its KV cache from it, the gateway its budget for held requests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 reports "no limit" as 2^63 - 1 rounded down to a page; anything this big is none.
UNLIMITED_BYTES = 1 << 60


@dataclass(frozen=True)
class MemorySources:
    """Where memory figures are read; tests point these at fake files."""

    cgroup_root: Path = Path("/sys/fs/cgroup")
    proc_self_cgroup: Path = Path("/proc/self/cgroup")
    meminfo: Path = Path("/proc/meminfo")


SYSTEM = MemorySources()


def available_memory_bytes(sources: MemorySources = SYSTEM) -> int:
    """Bytes this process can still use: the node's MemAvailable, capped by every cgroup limit."""
    return min([_mem_available(sources.meminfo), *_cgroup_headrooms(sources)])


def _mem_available(meminfo: Path) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_headrooms(sources: MemorySources) -> Iterator[int]:
    """Limit minus working set, for every limited cgroup above this process (v2 and v1)."""
    try:
        lines = sources.proc_self_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            yield from _headrooms(
                sources.cgroup_root, path, "memory.max", "memory.current", "inactive_file"
            )
        elif "memory" in controllers.split(","):
            yield from _headrooms(
                sources.cgroup_root / "memory",
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )


def _headrooms(
    mount: Path, path: str, limit_file: str, usage_file: str, inactive_key: str
) -> Iterator[int]:
    if not mount.is_dir():
        return  # this hierarchy is not mounted here
    # Inside a container the process's own cgroup is mounted as the root, so the path that
    # /proc/self/cgroup names (the host's view) may not exist: start from the deepest that does.
    directory = mount / path.lstrip("/")
    while not directory.is_dir() and directory != mount:
        directory = directory.parent
    while True:
        limit = _read_int(directory / limit_file)
        if limit is not None and limit < UNLIMITED_BYTES:
            usage = _read_int(directory / usage_file) or 0
            inactive = _stat_value(directory / "memory.stat", inactive_key)
            yield max(0, limit - max(0, usage - inactive))
        if directory == mount or directory.parent == directory:
            return
        directory = directory.parent


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file; None when absent or "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0
