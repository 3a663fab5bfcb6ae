"""The gateway app's typed keys: what ``create_app`` builds once and the handlers read."""

from __future__ import annotations

from aiohttp import web

from slotserve.gateway.admission.front import Admission
from slotserve.gateway.admission.window import AdmissionWindowWriter
from slotserve.gateway.http.api_keys import ApiKeys
from slotserve.gateway.http.memory_budget import MemoryBudget
from slotserve.gateway.http.metrics import GatewayMetrics
from slotserve.gateway.http.proxy import ProxyContext
from slotserve.gateway.pools.cold_start import ColdStarts
from slotserve.gateway.pools.config import PoolRegistry
from slotserve.gateway.pools.engines import EngineMonitor
from slotserve.gateway.settings import GatewaySettings

SETTINGS = web.AppKey("settings", GatewaySettings)
REGISTRY = web.AppKey("registry", PoolRegistry)
METRICS = web.AppKey("metrics", GatewayMetrics)
MONITOR = web.AppKey("monitor", EngineMonitor)
ADMISSION = web.AppKey("admission", Admission)
PROXY = web.AppKey("proxy", ProxyContext)
API_KEYS = web.AppKey("api_keys", ApiKeys)
COLD_STARTS = web.AppKey("cold_starts", ColdStarts)
BUDGET = web.AppKey("budget", MemoryBudget)  # bytes held by waiting and streaming requests
# Admission counts for the operator's status.admission: with Redis only (None without).
WINDOW: web.AppKey[AdmissionWindowWriter | None] = web.AppKey("admission_window")
