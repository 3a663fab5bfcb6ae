"""The `helm test` pod's script, run for real with curl against a real gateway process.

No cluster runs here, so the pod cannot be scheduled; its script is the part that can break, so
it runs unchanged except for paths (the Secret mount becomes a temp file) and shorter retries.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import free_port, http_ok, wait_until

KEY_MOUNT = "/etc/slotserve/api-keys/key"
KEYS = ["sk-chart-test-1", "sk-chart-test-2"]


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory) -> Iterator[str]:
    """A real `slotserve gateway` with file discovery, one pool and API keys required."""
    if shutil.which("curl") is None:
        pytest.fail("curl is needed to run the helm test pod's script", pytrace=False)
    work = tmp_path_factory.mktemp("gateway")
    (work / "pools.yaml").write_text(
        f'pools:\n  - model: smollm2\n    endpoints: ["http://127.0.0.1:{free_port()}"]\n'
    )
    (work / "keys").write_text("\n".join(KEYS) + "\n")
    port = free_port()
    log = (work / "gateway.log").open("w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTSERVE_GATEWAY_")}
    slotserve = str(Path(sys.executable).parent / "slotserve")
    proc = subprocess.Popen(
        [
            *(slotserve, "gateway", "--host", "127.0.0.1", "--port", str(port)),
            *("--config", str(work / "pools.yaml"), "--api-keys-file", str(work / "keys")),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_ok(f"{url}/ready") or proc.poll() is not None, timeout=60)
        if proc.poll() is not None:
            pytest.fail(f"gateway exited: {(work / 'gateway.log').read_text()[-2000:]}")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        log.close()


def pod_script(render, tmp_path: Path, values_file: str) -> tuple[str, Path]:
    """The test pod's script for ``values_file``, and the file standing in for the key mount."""
    (pod,) = render(values_file).of_kind("Pod")
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-ec"]
    script = container["args"][0]
    key_file = tmp_path / "key"
    script = script.replace("/tmp/models.json", str(tmp_path / "models.json"))
    script = script.replace(KEY_MOUNT, str(key_file))
    # Fewer, shorter retries: a failure must show within seconds here, not a minute.
    script = re.sub(r"--retry \d+", "--retry 1", script)
    script = re.sub(r"--retry-delay \d+", "--retry-delay 1", script)
    return script, key_file


def run_script(script: str, gateway: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", "-ec", script],
        env={"PATH": os.environ["PATH"], "GATEWAY": gateway},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_helm_test_passes_against_a_ready_gateway_with_the_first_key(render, tmp_path, gateway_url):
    script, key_file = pod_script(render, tmp_path, "api-keys.yaml")
    key_file.write_text("\n".join(KEYS) + "\n")
    result = run_script(script, gateway_url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"id": "smollm2"' in result.stdout
    assert "gateway is ready and lists its models" in result.stdout


def test_helm_test_sends_only_the_key_of_a_line_with_tenant_options(render, tmp_path, gateway_url):
    script, key_file = pod_script(render, tmp_path, "api-keys-tenants.yaml")
    key_file.write_text(f"{KEYS[0]} tenant=team-a weight=3 rpm=600\n")
    result = run_script(script, gateway_url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gateway is ready and lists its models" in result.stdout


def test_helm_test_fails_when_the_key_is_wrong(render, tmp_path, gateway_url):
    script, key_file = pod_script(render, tmp_path, "api-keys.yaml")
    key_file.write_text("sk-not-a-key\n")
    result = run_script(script, gateway_url)
    assert result.returncode != 0
    assert "invalid_api_key" in result.stdout + result.stderr


def test_helm_test_fails_without_a_key_when_the_gateway_requires_one(render, tmp_path, gateway_url):
    # The default values configure no keys, so the pod sends none.
    script, _ = pod_script(render, tmp_path, "hpa.yaml")
    assert run_script(script, gateway_url).returncode != 0


def test_helm_test_fails_when_the_gateway_is_down(render, tmp_path):
    script, key_file = pod_script(render, tmp_path, "api-keys.yaml")
    key_file.write_text(KEYS[0] + "\n")
    result = run_script(script, f"http://127.0.0.1:{free_port()}")
    assert result.returncode != 0
    assert "gateway is ready" not in result.stdout
