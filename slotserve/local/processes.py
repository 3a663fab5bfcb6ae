"""Start, watch and stop the child processes of ``slotserve up`` / ``slotserve demo``.

Every child runs in its own process group, so a Ctrl-C typed in the terminal reaches only the
parent, which then stops the children in order (gateway before engines before Redis). On Linux
each child also asks the kernel to kill it when the parent dies (``PR_SET_PDEATHSIG``), so not
even a ``kill -9`` of the parent leaves an orphan behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 25


class ChildExitedError(RuntimeError):
    """A child process exited while it was supposed to be running."""


@dataclass
class ChildSpec:
    """What to run, and how to tell that it is ready to take work."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    env: dict[str, str] | None = None
    stop_timeout_seconds: float = 15.0


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    ready_after_seconds: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, num_lines: int = _LOG_TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])


def http_ready(url: str) -> Callable[[], bool]:
    """A probe that is true once ``GET url`` answers 2xx."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return 200 <= resp.status < 300
        except (urllib.error.URLError, OSError, ValueError):
            return False

    return probe


def redis_ready(port: int, host: str = "127.0.0.1") -> Callable[[], bool]:
    """A probe that is true once a Redis server answers PING."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    return probe


def _death_signal_setup(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: die with the parent (Linux); resolved before fork, so the child only calls."""
    prctl: Callable[..., int] | None = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def setup() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        # The parent may have died between fork and prctl: then nobody would ever stop us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return setup


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Make SIGINT and SIGTERM interrupt like Ctrl-C, so ``finally`` blocks stop the children.

    SIGINT gets Python's default handler back (a shell starts background commands with SIGINT
    ignored), which ``asyncio.run`` replaces by its own graceful one; SIGTERM re-raises as SIGINT
    so that both paths are the same.
    """

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signal.raise_signal(signal.SIGINT)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, on_sigterm),
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class Supervisor:
    """Owns a set of children: start, wait until ready, watch, and stop them all.

    Use it as a context manager; leaving the block stops every child, whatever happened.
    """

    def __init__(self, log_dir: Path, console: Console | None = None) -> None:
        self.log_dir = log_dir
        self.console = console or Console(stderr=True)
        self.children: list[Child] = []

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, spec: ChildSpec) -> Child:
        """Start one child in its own process group, logging to ``<log_dir>/<name>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", spec.name).strip("-")
        log_path = self.log_dir / f"{slug}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(spec.env or {})}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                process_group=0,
                preexec_fn=_death_signal_setup(os.getpid()),
            )
        child = Child(spec=spec, proc=proc, log_path=log_path)
        self.children.append(child)
        return child

    def pids(self) -> list[int]:
        return [child.pid for child in self.children]

    def check_alive(self) -> None:
        """Raise ChildExitedError (with the end of its log) if any child has exited."""
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                raise ChildExitedError(
                    f"{child.name} exited with status {code}; last lines of {child.log_path}:\n"
                    f"{child.log_tail()}"
                )

    def wait_ready(self, children: list[Child], timeout_seconds: float) -> None:
        """Poll each child's readiness probe, showing progress, until all are ready.

        Raises ChildExitedError if one dies first and TimeoutError if they take too long.
        """
        deadline = time.monotonic() + timeout_seconds
        columns = (
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("{task.description:<22}"),
            TextColumn("{task.fields[state]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=self.console, transient=False) as progress:
            tasks = {
                child.name: progress.add_task(child.name, total=1, state="starting")
                for child in children
            }
            pending = list(children)
            while pending:
                for child in list(pending):
                    code = child.proc.poll()
                    if code is not None:
                        progress.update(tasks[child.name], state=f"[red]exited ({code})")
                        raise ChildExitedError(
                            f"{child.name} exited with status {code} before it was ready; "
                            f"last lines of {child.log_path}:\n{child.log_tail()}"
                        )
                    if child.spec.ready():
                        child.ready_after_seconds = time.monotonic() - child.started_at
                        progress.update(
                            tasks[child.name],
                            completed=1,
                            state=f"[green]ready[/] in {child.ready_after_seconds:.1f} s",
                        )
                        pending.remove(child)
                    else:
                        progress.update(tasks[child.name], state=_last_log_line(child))
                if pending and time.monotonic() > deadline:
                    names = ", ".join(child.name for child in pending)
                    tails = "\n".join(f"--- {c.name}:\n{c.log_tail()}" for c in pending)
                    raise TimeoutError(f"not ready after {timeout_seconds:.0f} s: {names}\n{tails}")
                if pending:
                    time.sleep(0.25)

    def stop_all(self) -> None:
        """Stop children newest first: SIGTERM to the group, then SIGKILL after a grace period.

        A second Ctrl-C while waiting skips the grace period.
        """
        for child in reversed(self.children):
            try:
                _stop_child(child)
            except KeyboardInterrupt:
                for rest in self.children:
                    _kill_group(rest.proc, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        rest.proc.wait(timeout=5)
                break
        self.children.clear()


def _last_log_line(child: Child) -> str:
    lines = [line for line in child.log_tail(5).splitlines() if line.strip()]
    text = lines[-1].strip() if lines else "starting"
    return f"[dim]{text[:70]}"


def _kill_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _stop_child(child: Child) -> None:
    if child.proc.poll() is None:
        _kill_group(child.proc, signal.SIGTERM)
        try:
            child.proc.wait(timeout=child.spec.stop_timeout_seconds)
        except subprocess.TimeoutExpired:
            _kill_group(child.proc, signal.SIGKILL)
            child.proc.wait(timeout=10)
    # Anything the child left behind in its group (it is the group leader) goes too.
    _kill_group(child.proc, signal.SIGKILL)
