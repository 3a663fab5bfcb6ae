"""A real `slotserve engine` process for the server tests: started on a free port, always killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_forkserver import ForkedProcess, start_engine
from tests.support import free_port, wait_until

SLOTSERVE = Path(sys.executable).with_name("slotserve")


class EngineProcess:
    """`slotserve engine --model DIR --port P ...` as a subprocess, logs kept for failures."""

    def __init__(self, model_dir: Path, log_path: Path, *flags: str, name: str = "tiny") -> None:
        self.port = free_port()
        self.name = name
        self.log_path = log_path
        self.argv = [
            str(SLOTSERVE), "engine",
            "--model", str(model_dir),
            "--served-model-name", name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--num-threads", "1",
            *flags,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True, timeout: float = 120) -> EngineProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = start_engine(self.argv, self.log_path, env)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"engine exited {self.proc.returncode}:\n{self.logs()}")
            return self.status("/ready") == 200

        try:
            wait_until(ready, timeout=timeout, interval=0.1, what="engine /ready")
        except TimeoutError:
            raise TimeoutError(f"engine not ready in {timeout}s:\n{self.logs()}") from None

    def status(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return None

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=5) as resp:
            return json.loads(resp.read())

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics keyed by (name, sorted labels)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def completion_body(max_tokens: int, *, stream: bool) -> dict:
    """A greedy completion that runs exactly ``max_tokens`` steps (EOS ignored) on "tiny"."""
    return {
        "model": "tiny",
        "prompt": "a",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def json_event(event: dict | str) -> dict:
    """One SSE payload whose fields a test reads: parsed JSON, not the "[DONE]" marker."""
    assert isinstance(event, dict), event
    return event


def sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def module_engine(
    label: str, *args: str, model: str = "tiny_model_dir"
) -> tuple[Callable[..., Iterator[EngineProcess]], Callable[..., openai.OpenAI]]:
    """Module-scoped ``engine`` (a real process on the ``model`` fixture's folder) and ``client``.

    Use as ``engine, client = module_engine("name", "--max-batch-size", "4")`` in a test module.
    """

    @pytest.fixture(scope="module")
    def engine(
        request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[EngineProcess]:
        log = tmp_path_factory.mktemp(label) / "engine.log"
        process = EngineProcess(request.getfixturevalue(model), log, *args).start()
        yield process
        process.stop()

    @pytest.fixture(scope="module")
    def client(engine: EngineProcess) -> openai.OpenAI:
        return openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)

    return engine, client
