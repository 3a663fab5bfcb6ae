"""State shared by the engine server's handlers, and the OpenAI-shaped error they raise."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from slotserve.contracts.headers import SLOTS_FREE_HEADER, SLOTS_TOTAL_HEADER
from slotserve.engine.http.metrics import EngineMetrics
from slotserve.engine.http.openai_responses import ErrorBody, ErrorDetail
from slotserve.engine.http.prefix_rows import PrefixRows
from slotserve.engine.settings import EngineSettings

if TYPE_CHECKING:
    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.core.stats import EngineStats


@dataclass
class ServerState:
    """Everything the handlers share; one per app (no globals)."""

    settings: EngineSettings
    preloaded: AsyncEngine | None
    engine: AsyncEngine | None = None  # set once loaded AND started: "ready" means this
    load_error: str | None = None
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    fatal: asyncio.Event = field(default_factory=asyncio.Event)
    fatal_exit_code: int = 1  # 2: the settings cannot run here (UnsupportedSettingError)
    started_at: int = field(default_factory=lambda: int(time.time()))
    metrics: EngineMetrics = field(init=False)
    prefix_rows: PrefixRows = field(default_factory=PrefixRows)  # /load's prefix keys

    def __post_init__(self) -> None:
        self.idle.set()
        self.metrics = EngineMetrics(
            model_name=lambda: self.engine.model_name if self.engine else None,
            stats=lambda: self.engine.stats() if self.engine else None,
            draining=lambda: self.draining,
        )

    def begin(self, request_id: str) -> None:
        self.in_flight.add(request_id)
        self.idle.clear()

    def end(self, request_id: str) -> None:
        self.in_flight.discard(request_id)
        if not self.in_flight:
            self.idle.set()


STATE = web.AppKey("slotserve_engine_state", ServerState)


class ApiError(Exception):
    """An error answered with OpenAI's body shape ``{"error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(
            error=ErrorDetail(message=message, type=type_, param=param, code=code)
        )
        self.headers = headers or {}

    def response(self) -> web.Response:
        return web.json_response(
            text=self.body.model_dump_json(), status=self.status, headers=self.headers
        )


def loaded_engine(state: ServerState) -> AsyncEngine:
    """The engine, or a 503 while it loads (or after its load failed)."""
    if state.engine is None:
        failed = state.load_error is not None
        raise ApiError(
            503,
            f"the model failed to load: {state.load_error}" if failed else "the model is loading",
            type_="service_unavailable_error",
            code="loading",
            headers={"Retry-After": "5"},
        )
    return state.engine


def accepting_engine(state: ServerState) -> AsyncEngine:
    """The engine if it takes new requests: loaded, not broken, not draining; else a 503."""
    engine = loaded_engine(state)
    if engine.failure is not None:
        raise broken_engine_error(engine.failure)
    if state.draining:
        raise ApiError(
            503,
            "the engine is shutting down; send the request to another replica",
            type_="service_unavailable_error",
            code="draining",
            headers={"Retry-After": "1", **slot_headers(engine.stats())},
        )
    return engine


def broken_engine_error(failure: str) -> ApiError:
    """The runner broke: this pod serves no more (its probes fail, so it is restarted)."""
    return ApiError(
        503,
        f"the engine is broken ({failure}); send the request to another replica",
        type_="service_unavailable_error",
        code="engine_failure",
        headers={"Retry-After": "1"},
    )


def slot_headers(stats: EngineStats) -> dict[str, str]:
    return {
        SLOTS_FREE_HEADER: str(stats.num_slots_free),
        SLOTS_TOTAL_HEADER: str(stats.num_slots_total),
    }
