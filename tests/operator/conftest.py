"""Fixtures of the operator suite: the kmock-based API server, the operator thread, a client.

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
from operator_apiserver import ApiServerThread  # noqa: E402
from operator_harness import Kube, OperatorThread  # noqa: E402
from slotserve.operator import crd  # noqa: E402
from slotserve.operator.kube import USER_AGENT  # noqa: E402
from slotserve.operator.rbac import REQUIRED_RULES  # noqa: E402
from slotserve.operator.settings import OperatorSettings  # noqa: E402
from support import free_port  # noqa: E402

ENGINE_IMAGE = "registry.test/slotserve/engine:test"


@pytest.fixture
def apiserver() -> Iterator[ApiServerThread]:
    server = ApiServerThread([crd.build_crd()]).start()
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


def allowed(verb: str, group: str, resource: str) -> bool:
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in REQUIRED_RULES
    )


def assert_rbac_covers(apiserver: ApiServerThread) -> None:
    """Every API call that kopf and the operator made is allowed by REQUIRED_RULES."""
    assert apiserver.server is not None
    made = {
        call[1:] for call in apiserver.server.calls if call[0].startswith(("kopf/", USER_AGENT))
    }
    missing = sorted(call for call in made if not allowed(*call))
    assert not missing, f"calls outside REQUIRED_RULES (verb, group, resource): {missing}"


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
