"""A gateway rollout with the chart's drain values: running streams finish, new ones go elsewhere.

The real gateway process (file discovery, in-process admission) in front of the engine double of
the gateway suite; the environment is what the rendered chart gives the gateway container. After
SIGTERM (what the kubelet sends once the preStop sleep is over) the gateway stops accepting
connections, so its readiness probe fails, and a stream already running ends with ``[DONE]``.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.charts.chart_support import RELEASE, ROOT, env_of
from tests.support import free_port, http_ok, wait_until

GATEWAY = f"{RELEASE}-slotserve-gateway"
DOUBLE = ROOT / "tests" / "gateway" / "gateway_engine_double.py"
STREAM_SECONDS = 4.0


@contextmanager
def process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def gateway_env(render, drain_seconds: int) -> dict[str, str]:
    rendered = render(extra=["--set", f"gateway.drainTimeoutSeconds={drain_seconds}"])
    (container,) = rendered.get("Deployment", GATEWAY)["spec"]["template"]["spec"]["containers"]
    name = "SLOTSERVE_GATEWAY_SHUTDOWN_TIMEOUT_SECONDS"
    return {name: env_of(container)[name]["value"]}


def stream(port: int, result: dict[str, object]) -> None:
    """One streaming completion; records the first-chunk time and the whole body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"model": "double", "prompt": "hi", "stream": True, "max_tokens": 8}
    body["x_delay"] = STREAM_SECONDS
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        chunks = [response.readline()]
        result["first_chunk"] = time.monotonic()
        while line := response.readline():
            chunks.append(line)
        result["body"] = b"".join(chunks).decode()
    except (OSError, http.client.HTTPException) as error:
        result["error"] = repr(error)
    finally:
        connection.close()


def run_rollout(render, tmp_path: Path, drain_seconds: int) -> tuple[dict[str, object], int]:
    engine_port, gateway_port = free_port(), free_port()
    pools = {
        "pools": [
            {
                "model": "double",
                "endpoints": [f"http://127.0.0.1:{engine_port}"],
                "batching": {"policy": "continuous", "maxBatchSize": 2},
            }
        ]
    }
    (tmp_path / "pools.yaml").write_text(yaml.safe_dump(pools))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTSERVE_")}
    double = [sys.executable, str(DOUBLE), "--port", str(engine_port), "--delay", "0"]
    gateway = [sys.executable, "-m", "slotserve.cli", "gateway", "--host", "127.0.0.1"]
    gateway += ["--port", str(gateway_port), "--config", str(tmp_path / "pools.yaml")]
    with (
        process(double, env, tmp_path / "double.log"),
        process(gateway, {**env, **gateway_env(render, drain_seconds)}, tmp_path / "gw.log") as gw,
    ):
        wait_until(lambda: http_ok(f"http://127.0.0.1:{gateway_port}/ready"), 30, what="ready")
        result: dict[str, object] = {}
        client = threading.Thread(target=stream, args=(gateway_port, result))
        client.start()
        wait_until(lambda: "first_chunk" in result or "error" in result, 10, what="first chunk")
        gw.send_signal(signal.SIGTERM)  # the kubelet, after the preStop sleep
        # Readiness fails at once: nothing new is sent to this replica.
        wait_until(lambda: not http_ok(f"http://127.0.0.1:{gateway_port}/ready"), 3, what="unready")
        client.join(STREAM_SECONDS + 15)
        returncode = gw.wait(30)
    return result, returncode


def test_a_running_stream_finishes_during_the_drain(render, tmp_path):
    result, returncode = run_rollout(render, tmp_path, drain_seconds=60)
    assert "error" not in result, result
    assert str(result["body"]).rstrip().endswith("data: [DONE]")
    assert returncode == 0, (tmp_path / "gw.log").read_text()[-2000:]


@pytest.mark.parametrize("drain_seconds", [1])
def test_a_drain_shorter_than_the_stream_cuts_it(render, tmp_path, drain_seconds):
    """The value matters: with 1 s the same stream is cut (why the default is 300 s)."""
    result, _ = run_rollout(render, tmp_path, drain_seconds)
    assert "data: [DONE]" not in str(result.get("body", "")), result
