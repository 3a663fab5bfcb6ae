"""NOTES.txt (shown after `helm install`) renders for every values file and its commands work."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.charts.chart_support import CHART, GOOD_VALUES, NAMESPACE, RELEASE, VALUES_DIR

GATEWAY = f"{RELEASE}-slotserve-gateway"
KEYS = ["sk-first-key", "sk-second-key"]


@pytest.fixture(scope="module")
def notes(run_helm):
    """NOTES per values file: `helm template` skips them, a client-side dry-run renders them."""
    cache: dict[str | None, str] = {}

    def get(values_file: str | None) -> str:
        if values_file not in cache:
            args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
            if values_file:
                args += ["--values", str(VALUES_DIR / values_file)]
            result = run_helm(args)
            assert result.returncode == 0, result.stderr
            cache[values_file] = result.stdout.split("NOTES:", 1)[1]
        return cache[values_file]

    return get


@pytest.mark.parametrize("values_file", [None, *GOOD_VALUES])
def test_notes_tell_how_to_apply_a_pool_and_call_the_gateway(notes, values_file):
    text = notes(values_file)
    # Pools go where the operator watches and the engine NetworkPolicy protects.
    pool_namespace = "team-a" if values_file == "namespaced-rbac.yaml" else NAMESPACE
    assert f"kubectl -n {pool_namespace} apply -f examples/smollm2-cpu.yaml" in text
    assert f"kubectl -n {pool_namespace} apply -f examples/llama-8b-gpu.yaml" in text
    assert "networkPolicy.engineNamespaces" not in text
    assert f"port-forward svc/{GATEWAY} 8080:80" in text
    assert "/v1/chat/completions" in text
    assert "kubectl apply --server-side -f crds/" in text
    assert f"helm test {RELEASE} -n {NAMESPACE}" in text


def test_notes_describe_the_chosen_redis(notes):
    assert "demo-slotserve-redis (bundled, single instance)" in notes(None)
    assert "external: rediss://redis.example.internal:6380/2" in notes("external-redis.yaml")
    assert "watches namespaces team-a, team-b" in notes("namespaced-rbac.yaml")


def test_notes_warn_when_the_gateway_is_open(notes):
    assert "accepts every caller" in notes(None)
    assert "accepts every caller" not in notes("api-keys.yaml")


@pytest.mark.parametrize(
    ("values_file", "secret", "key"),
    [
        ("api-keys.yaml", "demo-slotserve-api-keys", "api-keys"),
        ("operator-ha.yaml", "gateway-keys", "keys.txt"),
    ],
)
def test_notes_key_command_extracts_the_first_key(
    notes, helm_bin, tmp_path, values_file, secret, key
):
    """Run the NOTES' `export KEY=$(kubectl ... get secret ...)` with the real kubectl, offline."""
    (line,) = [ln.strip() for ln in notes(values_file).splitlines() if "export KEY=" in ln]
    match = re.fullmatch(
        r"export KEY=\$\(kubectl -n (\S+) get secret (\S+) -o (jsonpath='[^']+') (\| .+)\)", line
    )
    assert match, line
    namespace, name, output, rest = match.groups()
    assert (namespace, name) == (NAMESPACE, secret)
    keys_file = tmp_path / "keys"
    keys_file.write_text("\n".join(KEYS) + "\n")
    kubectl = helm_bin.parent / "kubectl"
    # The same Secret, built client-side instead of fetched from a cluster.
    offline = (
        f"{kubectl} create secret generic {name} --from-file={key}={keys_file} --dry-run=client"
    )
    result = subprocess.run(
        ["sh", "-c", f"{offline} -o {output} {rest}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == KEYS[0]


def test_notes_say_what_is_protected_and_what_is_weakened(run_helm):
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
    default = run_helm(args)
    assert default.returncode == 0, default.stderr
    assert "Each pool gets a NetworkPolicy from the operator" in default.stdout
    assert "allowHostPath" not in default.stdout and "WARNING" not in default.stdout
    weakened = run_helm(
        [
            *args,
            "--set",
            "policy.allowHostPath=true",
            "--set",
            "redis.bundled.auth.enabled=false",
        ]
    )
    assert weakened.returncode == 0, weakened.stderr
    assert "policy.allowHostPath is on" in weakened.stdout
    assert "redis.bundled.auth.enabled=false: Redis answers anyone" in weakened.stdout
