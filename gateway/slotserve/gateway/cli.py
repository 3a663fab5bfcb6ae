"""``slotserve gateway``: serve the OpenAI API in front of engine pools, with admission."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from aiohttp import web

from slotserve.gateway.http.api_keys import ApiKeysError
from slotserve.gateway.pools.config import PoolConfigError
from slotserve.gateway.settings import GatewaySettings
from slotserve.settings import cli_settings, configure_logging
from slotserve.tracing import TracingUnavailableError, shutdown_provider, tracer_provider_from_env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slotserve gateway",
        description="Admit and route OpenAI API requests to engine pools "
        "(flags override SLOTSERVE_GATEWAY_* variables).",
    )
    p.add_argument("--host", default=None, help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=None, help="port (default 8080)")
    p.add_argument("--config", default=None, help="pool file (YAML), reloaded when it changes")
    p.add_argument("--redis-url", default=None, help="Redis URL; unset = in-process admission")
    p.add_argument("--discovery", choices=["file", "kubernetes"], default=None)
    p.add_argument("--namespaces", default=None, help="comma list (kubernetes discovery)")
    p.add_argument(
        "--model-namespaces",
        default=None,
        help="which namespaces may serve which model names: 'llama-*=platform,ml;smollm2=platform'",
    )
    p.add_argument(
        "--api-keys-file", default=None, help="one API key per line, reloaded when it changes"
    )
    p.add_argument(
        "--metrics-require-api-key",
        action="store_const",
        const=True,
        default=None,
        help="serve /metrics only with a valid API key",
    )
    p.add_argument("--redis-prefix", default=None, help="prefix of every Redis key")
    p.add_argument("--lease-ttl-seconds", type=float, default=None)
    p.add_argument("--default-priority", type=int, default=None, help="1 (highest) .. 9")
    p.add_argument(
        "--priority-aging-seconds",
        type=float,
        default=None,
        help="waiting this long is worth one priority level (2; a pool may set its own)",
    )
    p.add_argument(
        "--hold-at-zero",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="hold requests for a pool with no ready engine until one is up (default on); "
        "--no-hold-at-zero: 503 no_ready_endpoint at once",
    )
    p.add_argument(
        "--deadline-refusal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refuse at once (429 deadline) a request whose predicted queue wait exceeds its "
        "deadline or the queue timeout (default off)",
    )
    p.add_argument(
        "--cold-start-seconds",
        type=float,
        default=None,
        help="an engine's start time for pools that state none (30): the Retry-After of a "
        "request held for a pool at zero that timed out",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    settings = cli_settings(GatewaySettings, args, "slotserve gateway")
    if settings is None:
        return 2
    if settings.discovery == "file" and settings.config is None:
        print("slotserve gateway: --config is required with file discovery", file=sys.stderr)
        return 2
    try:
        tracer_provider = tracer_provider_from_env("slotserve-gateway", os.environ)
    except TracingUnavailableError as exc:
        print(f"slotserve gateway: {exc}", file=sys.stderr)
        return 2
    from slotserve.gateway.http.app import create_app

    try:
        app = create_app(settings, tracer_provider)
        web.run_app(
            app,
            host=settings.host,
            port=settings.port,
            handler_cancellation=True,
            shutdown_timeout=settings.shutdown_timeout_seconds,
            access_log=None,
            print=lambda *_: logging.getLogger(__name__).info(
                "gateway listening on %s:%d", settings.host, settings.port
            ),
        )
    except (PoolConfigError, ApiKeysError) as exc:
        print(f"slotserve gateway: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"slotserve gateway: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_provider(tracer_provider)  # the last spans
    return 0
