"""Fixtures of the local-stack suite: run slotserve commands as a user would, output captured."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest


class CommandRun:
    """A slotserve subprocess whose output lines are collected by a reader thread."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slotserve.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def kill_tree(self) -> None:
        import psutil

        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        for process in [*tree]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def slotserve_command(tmp_path: Path) -> Iterator[type[CommandRun]]:
    """Start `slotserve ...` subprocesses; whatever is left of them is killed at teardown."""
    runs: list[CommandRun] = []

    def start(args: list[str]) -> CommandRun:
        run = CommandRun(args, cwd=tmp_path)
        runs.append(run)
        return run

    yield start  # type: ignore[misc]
    for run in runs:
        run.kill_tree()
