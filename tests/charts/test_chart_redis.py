"""The bundled Redis container's command line, run with the real redis-server binary.

By default it starts through ``sh -c`` (the password goes into a config file, not argv); the
tests run it as written, with the Secret's value in the environment as the kubelet would set it.
"""

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

from tests.support import free_port, wait_until

REDIS = "demo-slotserve-redis"


PASSWORD = "Zq7rT2pL9xW4vB8nK3mC6hJ1sD5fG0aE"  # what the chart's Secret would hold


def redis_command(render, *values_files: str, extra: tuple[str, ...] = ()) -> list[str]:
    statefulset = render(*values_files, extra=extra).get("StatefulSet", REDIS)
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    data_mount = next(m for m in container["volumeMounts"] if m["name"] == "data")
    assert data_mount["mountPath"] == "/data"
    return [*container["command"], *container["args"]]


@contextmanager
def running(
    command: list[str], data_dir: Path, password: str | None = PASSWORD
) -> Iterator[redis.Redis]:
    """Start the command as written, but on a free port and with temp folders for /data, /tmp."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is needed (make test installs it)", pytrace=False)
    port = free_port()
    scratch = data_dir / "tmp"
    scratch.mkdir(exist_ok=True)
    args = [
        str(data_dir) if arg == "/data" else arg.replace("/tmp/", f"{scratch}/") for arg in command
    ]
    args[args.index("--port") + 1] = str(port)
    env = {**os.environ, "REDIS_PASSWORD": password or ""}
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    client = redis.Redis(port=port, socket_timeout=2, password=password)
    try:

        def answers() -> bool:
            if proc.poll() is not None:
                return True
            try:
                return bool(client.ping())
            except (redis.ConnectionError, redis.AuthenticationError):
                return False

        wait_until(answers, timeout=20, what="redis-server to answer PING")
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        yield client
    finally:
        client.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_bundled_redis_requires_the_password_from_the_secret(render, tmp_path):
    command = redis_command(render)
    assert command[:2] == ["sh", "-c"] and PASSWORD not in " ".join(command)
    with running(command, tmp_path) as client:
        assert client.ping()
        port = client.connection_pool.connection_kwargs["port"]
        with pytest.raises(redis.AuthenticationError):  # no password: refused
            redis.Redis(port=port, socket_timeout=2).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2, password="wrong").ping()
    assert oct((tmp_path / "tmp" / "redis.conf").stat().st_mode & 0o777) == "0o600"


def test_password_off_is_a_plain_redis_server(render, tmp_path):
    command = redis_command(render, extra=("--set", "redis.bundled.auth.enabled=false"))
    assert command[0] == "redis-server"
    with running(command, tmp_path, password=None) as client:
        assert client.ping()


def test_bundled_redis_starts_with_the_rendered_flags(render, tmp_path):
    command = redis_command(render)
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
