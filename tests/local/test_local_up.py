"""`slotserve up` as a user runs it: a chat answer via the gateway, Ctrl-C, no leftovers."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest
from openai import OpenAI

from tests.local.local_support import stack_missing, still_running
from tests.support import free_port, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(stack_missing() is not None, reason=str(stack_missing())),
]


def _wait_for_banner(up) -> None:
    def banner_shown() -> bool:
        if up.proc.poll() is not None:
            raise AssertionError(f"slotserve up exited early:\n{up.output}")
        return "Press Ctrl-C to stop" in up.output

    wait_until(banner_shown, timeout=240, interval=0.5, what="slotserve up to be ready")


def _curl_example(output: str) -> str:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("curl "))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\\"))
    return "\n".join(lines[start : end + 1])


def _python_example(output: str) -> str:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("python - <<'EOF'"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == "EOF")
    # `python` here is this interpreter, which has the openai package.
    return "\n".join([f"{sys.executable} - <<'EOF'", *lines[start + 1 : end + 1]])


def test_up_answers_through_the_gateway_and_ctrl_c_stops_every_child(
    tiny_model_dir, tmp_path, slotserve_command
):
    port = free_port()
    up = slotserve_command(
        [
            "up",
            "--model", str(tiny_model_dir),
            "--served-model-name", "tiny",
            "--engines", "2",
            "--port", str(port),
            "--num-threads", "1",
            "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    _wait_for_banner(up)
    gateway = f"http://127.0.0.1:{port}"
    assert f"gateway {gateway}" in up.output
    assert "2 engine(s)" in up.output

    client = OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=60)
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    assert answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content

    # The printed curl example runs as written.
    curl = subprocess.run(
        ["bash", "-c", _curl_example(up.output)], capture_output=True, text=True, timeout=60
    )
    assert curl.returncode == 0 and '"choices"' in curl.stdout, curl.stdout + curl.stderr
    example = subprocess.run(
        ["bash", "-c", _python_example(up.output)], capture_output=True, text=True, timeout=60
    )
    assert example.returncode == 0, example.stdout + example.stderr

    tree = psutil.Process(up.proc.pid).children(recursive=True)
    pids = [process.pid for process in tree]
    names = " ".join(" ".join(process.cmdline()) for process in tree)
    assert names.count(" engine ") == 2 and " gateway " in names
    assert "redis-server" in names  # on PATH here, so `up` starts its own

    up.proc.send_signal(signal.SIGINT)
    assert up.wait(timeout=90) == 0, up.output
    assert "Stopped" in up.output
    assert still_running(pids) == []


def test_up_without_redis_stops_cleanly_on_sigterm(tiny_model_dir, tmp_path, slotserve_command):
    port = free_port()
    up = slotserve_command(
        [
            "up",
            "--model", str(tiny_model_dir),
            "--engines", "1",
            "--no-redis",
            "--port", str(port),
            "--num-threads", "1",
            "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    _wait_for_banner(up)
    assert "in-process admission" in up.output
    model = tiny_model_dir.name  # the served name defaults to the folder name
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(
        model=model, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert answer.choices[0].finish_reason == "length"

    started = psutil.Process(up.proc.pid).children(recursive=False)
    assert len(started) == 2  # one engine and the gateway, no Redis
    # The engine's own helpers (its tokenizer worker) must not outlive it either.
    pids = [p.pid for p in psutil.Process(up.proc.pid).children(recursive=True)]
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait(timeout=90) == 0, up.output
    assert still_running(pids) == []
