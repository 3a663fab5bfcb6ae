"""``slotserve operator``: run the InferencePool operator (kopf) until SIGTERM.

Cluster-wide by default, or only in ``--namespaces``. Several replicas are safe with kopf peering
(``--peering-name`` and kopf's peering CRDs): each replica takes a random priority, the highest
one works and the others stand by until it exits or its keep-alive expires.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import threading
from typing import Any

import kopf

from slotserve.operator.builders import MANAGED_BY, POOL_LABEL
from slotserve.operator.handlers import (
    DEPLOYMENTS,
    NETWORK_POLICIES,
    PODS,
    SERVICES,
    PoolOperator,
)
from slotserve.operator.settings import OperatorSettings
from slotserve.settings import cli_settings, configure_logging


def kopf_settings() -> kopf.OperatorSettings:
    """kopf's knobs: progress in annotations (our status schema has no room for kopf's)."""
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="slotserve.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="slotserve.dev", key="last-handled-configuration"
    )
    # Events for warnings and errors only; a reconcile that worked is not news.
    settings.posting.level = logging.WARNING
    settings.watching.reconnect_backoff = 1.0
    # A server-side watch timeout makes watches reconnect (resuming from a resourceVersion).
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Server-side filtering: watch only the engine pods and children, not every pod in the
    # cluster (the handlers' label filters alone would run client-side).
    children = f"{POOL_LABEL},app.kubernetes.io/managed-by={MANAGED_BY}"
    for resource in (PODS, DEPLOYMENTS, SERVICES, NETWORK_POLICIES):
        settings.watching.label_selectors[resource] = children
    return settings


def operator_kwargs(settings: OperatorSettings) -> dict[str, Any]:
    """The arguments of ``kopf.operator`` for these settings (scope, peering, health)."""
    kwargs: dict[str, Any] = {
        "registry": PoolOperator(settings).build_registry(),
        "settings": kopf_settings(),
        "liveness_endpoint": f"http://0.0.0.0:{settings.health_port}/healthz",
    }
    if settings.namespaces:
        kwargs["namespaces"] = list(settings.namespaces)
    else:
        kwargs["clusterwide"] = True
    if settings.peering_name:
        kwargs["peering_name"] = settings.peering_name
        kwargs["priority"] = (
            settings.priority if settings.priority is not None else random.randint(1, 2**30)
        )
    return kwargs


async def run(
    config: OperatorSettings,
    *,
    stop_flag: threading.Event | asyncio.Event | None = None,
    ready_flag: threading.Event | asyncio.Event | None = None,
    **overrides: Any,
) -> None:
    """Run the operator until ``stop_flag`` is set (or a signal arrives).

    ``overrides`` replace ``kopf.operator`` arguments (e.g. ``settings``, ``standalone``).
    """
    kwargs = operator_kwargs(config) | overrides
    await kopf.operator(stop_flag=stop_flag, ready_flag=ready_flag, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotserve operator",
        description="Reconcile InferencePool objects into engine Deployments and Services.",
    )
    parser.add_argument(
        "--namespaces",
        default=None,
        help="comma list of namespaces to watch (env SLOTSERVE_OPERATOR_NAMESPACES; "
        "default: the whole cluster)",
    )
    parser.add_argument(
        "--health-port", type=int, default=None, help="port of GET /healthz (default 8080)"
    )
    parser.add_argument(
        "--engine-image", default=None, help="engine image for pools that name none"
    )
    parser.add_argument(
        "--peering-name", default=None, help="kopf peering object shared by the replicas"
    )
    parser.add_argument("--priority", type=int, default=None, help="peering priority")
    parser.add_argument(
        "--allow-host-path",
        action="store_const",
        const=True,
        default=None,
        help="accept hostPath model sources (default: refused; pods then fail PSS restricted)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=None,
        help="re-apply every pool this often (default 300)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    return parser


def main(argv: list[str]) -> int:
    """Parse flags, then run the operator; returns the exit status."""
    args = build_parser().parse_args(argv)
    settings = cli_settings(OperatorSettings, args, "slotserve operator")
    if settings is None:
        return 2
    configure_logging(args.log_level)
    asyncio.run(run(settings))
    return 0
