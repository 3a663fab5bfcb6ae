"""Opt-in pytest plugin: the CPU time each test costs, its child processes included.

``--durations`` reports wall time, which on 2 cores shared by six workers mostly measures the
other workers: a test that waits on an engine looks as long as one that computes. The suite is
CPU-bound (two busy cores from its first test to its last), so its length is the sum of what
its tests burn. This plugin reads, before and after each test (setup and teardown included),
the CPU time of the worker's process tree (each live descendant's own time and that of the
children it has reaped: engines, Redis, gateways, the fork server) and appends one JSON line a
test to ``$SLOTSERVE_CPU_USAGE_DIR/<worker>-<pid>.jsonl``::

    SLOTSERVE_CPU_USAGE_DIR=/tmp/cpu .venv/bin/pytest -p tests.cpu_usage -n 6 --dist loadfile \\
        -m "not serial"

Linux only (``/proc``). A process that leaves the tree (daemonized, reparented to init) is not
counted after it leaves.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from pathlib import Path
from typing import IO

import pytest

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and its live descendants, each with its reaped children's."""
    parent_of: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # Fields after the command name (which may hold spaces and parentheses).
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry.name)
        parent_of[pid] = int(fields[1])
        ticks[pid] = sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    children: dict[int, list[int]] = {}
    for pid, parent in parent_of.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, ()))
    return total / TICKS_PER_SECOND


class CpuUsage:
    def __init__(self, folder: Path) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        folder.mkdir(parents=True, exist_ok=True)
        self._out: IO[str] = (folder / f"{worker}-{os.getpid()}.jsonl").open("a")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        cpu, wall = tree_cpu_seconds(os.getpid()), time.monotonic()
        yield
        record = {
            "id": item.nodeid,
            "cpu_s": round(tree_cpu_seconds(os.getpid()) - cpu, 3),
            "wall_s": round(time.monotonic() - wall, 3),
        }
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()


def pytest_configure(config: pytest.Config) -> None:
    folder = os.environ.get("SLOTSERVE_CPU_USAGE_DIR")
    if not folder:
        raise pytest.UsageError("tests.cpu_usage needs SLOTSERVE_CPU_USAGE_DIR (a folder)")
    config.pluginmanager.register(CpuUsage(Path(folder)), "slotserve-cpu-usage")
