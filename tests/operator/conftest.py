"""Operator suite fixtures: the emulated API server (tests/kubeapi), the operator thread, a client.

The kubernetes package reads $KUBECONFIG once, when it is first imported, so point it at a fixed
file right now, before anything imports it, and rewrite that file for every test's API server.
(slotserve's own code reads $KUBECONFIG when it connects, so it would cope either way.)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

KUBECONFIG = Path(tempfile.mkdtemp(prefix="slotserve-operator-tests-")) / "kubeconfig"
KUBECONFIG.write_text("{}")
os.environ["KUBECONFIG"] = str(KUBECONFIG)

import pytest  # noqa: E402

from slotserve.operator import crd  # noqa: E402
from slotserve.operator.settings import OperatorSettings  # noqa: E402

# The admission and autoscaling tests run real gateway processes (the gateway suite's helpers).
from tests.gateway.gateway_support import Spawner  # noqa: E402
from tests.kubeapi import ApiServerThread  # noqa: E402
from tests.operator.operator_harness import Kube, OperatorThread, assert_rbac_covers  # noqa: E402
from tests.support import free_port  # noqa: E402

ENGINE_IMAGE = "registry.test/slotserve/engine:test"


@pytest.fixture
def extra_crds() -> list[dict]:
    """More CRDs the API server serves (a test parametrizes this, e.g. with KEDA's)."""
    return []


@pytest.fixture
def apiserver(extra_crds: list[dict]) -> Iterator[ApiServerThread]:
    server = ApiServerThread([crd.build_crd(), *extra_crds]).start()
    KUBECONFIG.write_text(server.kubeconfig())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def kube(apiserver: ApiServerThread) -> Kube:
    return Kube()


@pytest.fixture
def operator_settings() -> OperatorSettings:
    return OperatorSettings(engine_image=ENGINE_IMAGE, health_port=free_port())


@pytest.fixture
def operator(
    apiserver: ApiServerThread, operator_settings: OperatorSettings
) -> Iterator[OperatorThread]:
    running = OperatorThread(operator_settings).start()
    try:
        yield running
    finally:
        running.stop()
    # Checked after every scenario: the chart's ClusterRole (which must equal REQUIRED_RULES)
    # lets the operator do everything it just did.
    assert_rbac_covers(apiserver)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawner]:
    """Gateway and engine-double processes for a test, all stopped at its end."""
    spawner = Spawner(tmp_path)
    try:
        yield spawner
    finally:
        spawner.stop_all()
