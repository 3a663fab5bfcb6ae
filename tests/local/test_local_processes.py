"""The supervisor with real child processes: readiness, failure reports, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from slotserve.local.processes import ChildExitedError, ChildSpec, Supervisor, http_ready
from tests.local.local_support import gone
from tests.support import free_port, wait_until


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def test_children_become_ready_then_all_stop_in_their_own_groups(tmp_path):
    ports = [free_port(), free_port()]
    with Supervisor(tmp_path) as supervisor:
        children = [
            supervisor.start(
                ChildSpec(f"web{i}", _http_server(port), http_ready(f"http://127.0.0.1:{port}/"))
            )
            for i, port in enumerate(ports)
        ]
        supervisor.wait_ready(children, timeout_seconds=30)
        assert all(child.ready_after_seconds is not None for child in children)
        pids = supervisor.pids()
        # Own process group: a Ctrl-C typed in the terminal reaches only the parent.
        assert all(os.getpgid(pid) == pid != os.getpgid(0) for pid in pids)
        supervisor.check_alive()
    assert all(gone(pid) for pid in pids)


def test_a_child_that_dies_while_starting_is_reported_with_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('model not found: /nope'); sys.exit(3)"]
    with Supervisor(tmp_path) as supervisor:
        child = supervisor.start(ChildSpec("engine", argv, lambda: False))
        with pytest.raises(ChildExitedError, match=r"status 3[\s\S]*model not found"):
            supervisor.wait_ready([child], timeout_seconds=30)


def test_a_child_that_never_gets_ready_times_out(tmp_path):
    argv = [sys.executable, "-c", "import time; print('loading'); time.sleep(60)"]
    with Supervisor(tmp_path) as supervisor:
        child = supervisor.start(ChildSpec("slow", argv, lambda: False))
        with pytest.raises(TimeoutError, match="slow"):
            supervisor.wait_ready([child], timeout_seconds=1)
    assert gone(child.pid)


def test_a_child_ignoring_sigterm_is_killed_after_its_grace_period(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    with Supervisor(tmp_path) as supervisor:
        child = supervisor.start(
            ChildSpec(
                "stubborn", [sys.executable, "-c", code], lambda: True, stop_timeout_seconds=0.5
            )
        )
        time.sleep(0.5)
    assert gone(child.pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_die_with_a_parent_killed_by_sigkill(tmp_path):
    """Even a kill -9 of the parent (no finally runs) leaves no orphan behind."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from slotserve.local.processes import ChildSpec, Supervisor
        sup = Supervisor(Path({str(tmp_path)!r}))
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        child = sup.start(ChildSpec("sleeper", argv, lambda: True))
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None  # stdout=PIPE
        child_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        wait_until(lambda: gone(child_pid), timeout=10, what="orphaned child to die")
    finally:
        if parent.poll() is None:
            parent.kill()
