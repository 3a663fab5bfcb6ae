"""The bundled Redis container's command line, run with the real redis-server binary."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from support import free_port, wait_until

REDIS = "demo-slotserve-redis"


def redis_command(render, *values_files: str) -> list[str]:
    statefulset = render(*values_files).get("StatefulSet", REDIS)
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    data_mount = next(m for m in container["volumeMounts"] if m["name"] == "data")
    assert data_mount["mountPath"] == "/data"
    return [*container["command"], *container["args"]]


@contextmanager
def running(command: list[str], data_dir: Path) -> Iterator[redis.Redis]:
    """Start the command as written, but on a free port and with a temp folder for /data."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is needed (make test installs it)", pytrace=False)
    port = free_port()
    args = [str(data_dir) if arg == "/data" else arg for arg in command]
    args[args.index("--port") + 1] = str(port)
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    client = redis.Redis(port=port, socket_timeout=2)
    try:

        def answers() -> bool:
            if proc.poll() is not None:
                return True
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(answers, timeout=20, what="redis-server to answer PING")
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        yield client
    finally:
        client.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_bundled_redis_starts_with_the_rendered_flags(render, tmp_path):
    command = redis_command(render)
    assert command[0] == "redis-server"
    with running(command, tmp_path) as client:
        assert client.config_get("maxmemory")["maxmemory"] == str(200 * 1024 * 1024)
        # Admission keys must never be evicted silently: writes fail at the cap instead.
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert client.config_get("appendonly")["appendonly"] == "no"
        assert client.config_get("save")["save"] == ""
        client.set("slotserve:probe", "1", ex=5)
        client.save()  # an explicit SAVE still works; nothing else writes to the disk
    assert not list(tmp_path.glob("appendonly*"))


def test_persistent_redis_keeps_data_across_a_restart(render, tmp_path):
    command = redis_command(render, "api-keys.yaml")  # persistence on
    with running(command, tmp_path) as client:
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("dir")["dir"] == str(tmp_path)
        client.set("slotserve:kept", "yes")
    # Killed with SIGKILL, like a node failure: the append-only file still has the write.
    with running(command, tmp_path) as client:
        assert client.get("slotserve:kept") == b"yes"
