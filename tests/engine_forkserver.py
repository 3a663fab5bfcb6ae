"""Engine processes for the tests, forked from one that has already imported torch and transformers.

The suite starts ~40 real `slotserve engine` processes; each spent ~3 of its ~3.7 CPU-seconds of
start-up importing torch, transformers' modeling code (which pulls torch._dynamo and
torch.distributed.tensor) and the engine's modules, on a 2-core CI runner where the suite is
CPU-bound. A fork server (the idea of multiprocessing's forkserver start method, for a command
line rather than a function) imports them once per test worker, before any thread or torch op
runs, and forks a child per engine that runs ``slotserve.cli.main`` with the argv, environment,
log and working folder a ``subprocess.Popen`` of the ``slotserve`` script would have had. The child
is the real engine from its argument parsing on: only the imports are shared.

Where a start cannot be faithful (an environment that differs in what torch, libgomp or Python
read at import: ``OMP_*``, ``TORCH_*``, ``PYTHON*``, ...), it runs the script as before, and
``SLOTSERVE_TEST_FORKSERVER=0`` runs every engine that way.

Protocol (JSON lines over the server's stdin/stdout): ``{"op": "fork", "argv", "env", "cwd",
"log"}`` answers ``{"pid"}``; ``{"op": "poll", "pid"}`` answers ``{"code"}`` (None while it runs;
negative for a signal, as Popen's returncode). On end of input the server kills its children.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

# What torch, libgomp, tokenizers and Python read once at import: a start whose environment
# differs from the server's in one of these runs the script instead.
IMPORT_TIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "TORCH", "PYTORCH", "PYTHON", "LD_", "HF_")
SCRIPT = Path(sys.executable).with_name("slotserve")


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    # PYTHONUNBUFFERED is the one the server honours anyway: it runs with -u.
    return {
        k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k != "PYTHONUNBUFFERED"
    }


# ----------------------------------------------------------------------------- server side


def _serve() -> None:
    from slotserve.engine.core.openmp import apply_openmp_environment

    apply_openmp_environment()  # as the engine's CLI does, before torch loads
    import slotserve.cli
    import slotserve.engine.cli
    import slotserve.engine.core.model.loader
    import slotserve.engine.http.server  # noqa: F401  (the imports are the point)

    children: set[int] = set()
    lines = os.fdopen(0, "rb", buffering=0)
    os.write(1, b'{"ready": true}\n')
    for raw in lines:
        request = json.loads(raw)
        if request["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                _child(request)  # never returns
            children.add(pid)
            reply: dict[str, Any] = {"pid": pid}
        else:
            pid = request["pid"]
            done, status = os.waitpid(pid, os.WNOHANG) if pid in children else (pid, 0)
            code = os.waitstatus_to_exitcode(status) if done else None
            if done:
                children.discard(pid)
            reply = {"code": code}
        os.write(1, json.dumps(reply).encode() + b"\n")
    for pid in children:  # the test worker is done or gone: leave nothing behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _child(request: dict[str, Any]) -> None:
    code: object = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        # As under the script: a spawned child (the tokenizer worker) re-imports __main__ from
        # the script's path, not this server's module.
        main = types.ModuleType("__main__")
        main.__file__ = str(SCRIPT)
        sys.modules["__main__"] = main
        import slotserve.cli

        code = slotserve.cli.main(sys.argv[1:])
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


# ----------------------------------------------------------------------------- client side


class ForkedProcess:
    """The parts of ``subprocess.Popen`` the tests use, for a child of the fork server."""

    def __init__(self, server: ForkServer, pid: int, argv: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.request({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a reaped pid: it may be someone else's now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One per test worker, started on first use; thread-safe (tests poll from threads)."""

    _instance: ForkServer | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._env = dict(os.environ)
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "tests.engine_forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert self._read() == {"ready": True}

    @classmethod
    def shared(cls) -> ForkServer:
        if cls._instance is None or cls._instance._proc.poll() is not None:
            cls._instance = cls()
            atexit.register(cls._instance.close)
        return cls._instance

    def close(self) -> None:
        """End the server: it kills and reaps what is left, so their CPU time is counted here."""
        with self._lock, contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine fork server exited ({self._proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(message).encode() + b"\n")
            self._proc.stdin.flush()
            return self._read()

    def can_fork(self, env: dict[str, str]) -> bool:
        return _import_time_env(env) == _import_time_env(self._env)

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedProcess:
        message = {"op": "fork", "argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log)}
        return ForkedProcess(self, self.request(message)["pid"], argv)


def start_engine(
    argv: list[str], log: Path, env: dict[str, str]
) -> subprocess.Popen[bytes] | ForkedProcess:
    """``argv`` (``slotserve engine ...``) forked from the server where it is faithful, else run."""
    engine = Path(argv[0]).name == SCRIPT.name and argv[1:2] == ["engine"]
    if engine and os.environ.get("SLOTSERVE_TEST_FORKSERVER", "1") != "0":
        server = ForkServer.shared()
        if server.can_fork(env):
            return server.fork(argv, env, log)
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


if __name__ == "__main__":
    _serve()
