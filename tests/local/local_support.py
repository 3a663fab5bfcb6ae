"""Helpers of the local-stack suite (a unique module name: tests/ has no packages)."""

from __future__ import annotations

import importlib.util


def stack_missing() -> str | None:
    """Why `slotserve up` cannot run in this checkout yet (engine or gateway not landed)."""
    for module in (
        "slotserve.engine.server",
        "slotserve.engine.async_engine",
        "slotserve.gateway.cli",
    ):
        if importlib.util.find_spec(module) is None:
            return f"{module} does not exist yet: the engine and gateway must land first"
    return None
