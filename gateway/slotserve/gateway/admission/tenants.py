"""Tenants: who is asking. A tenant groups API keys and carries a weight and optional limits.

Tenants are declared in the API keys file (``api_keys.py``), on the lines of their keys::

    sk-team-a-1  tenant=team-a weight=3 max-inflight=8 rpm=600 tpm=200000
    sk-team-a-2  tenant=team-a
    sk-team-b    tenant=team-b rpm=60

A tenant's weight and limits may be stated on any one of its keys' lines; stated on several they
must agree (else the file is refused, naming the line). A key without ``tenant=``, and every
request when no keys file is configured, belongs to the tenant ``default``.

Every name and number is bounded here, at load, so nothing a keys file holds can become an
unbounded Redis key, metrics label or Lua number (``lua/quotas.py`` keeps its integers exact
below 2**53: ``MAX_PER_MINUTE`` times ``quotas.UNITS_PER_TOKEN`` stays far below that).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aiohttp import web

# The name's pattern and the weight's bound are admission's (the fair share takes them).
from slotserve.gateway.admission.types import MAX_WEIGHT, TENANT_NAME

DEFAULT_TENANT = "default"
MAX_TENANT_NAME = 63  # a DNS label's length: fits a metrics label and a Redis key part
MAX_INFLIGHT = 1_000_000
MAX_PER_MINUTE = 10_000_000_000  # requests or tokens per minute
_DIGITS = re.compile(r"[0-9]{1,12}")  # ASCII digits only (int() also takes '٣', '1_0', ' 5')

# Option name on a key line -> (Tenant field, lowest, highest).
LIMIT_OPTIONS = {
    "weight": ("weight", 1, MAX_WEIGHT),
    "max-inflight": ("max_inflight", 0, MAX_INFLIGHT),
    "rpm": ("requests_per_minute", 0, MAX_PER_MINUTE),
    "tpm": ("tokens_per_minute", 0, MAX_PER_MINUTE),
}


class TenantError(ValueError):
    """A tenant option that cannot be taken; the message names the option, never the key."""


@dataclass(frozen=True)
class Tenant:
    """One tenant's declaration. ``None`` limits are unlimited; 0 refuses every request."""

    name: str = DEFAULT_TENANT
    weight: int = 1
    max_inflight: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def limited(self) -> bool:
        return (
            self.max_inflight is not None
            or self.requests_per_minute is not None
            or self.tokens_per_minute is not None
        )

    @property
    def has_zero_quota(self) -> bool:
        """A limit of zero: every request is refused at once (nothing ever refills)."""
        return 0 in (self.max_inflight, self.requests_per_minute, self.tokens_per_minute)


DEFAULT = Tenant()


def check_tenant_name(name: str) -> str:
    if len(name) > MAX_TENANT_NAME or not TENANT_NAME.fullmatch(name):
        raise TenantError(
            f"tenant= must be 1-{MAX_TENANT_NAME} letters, digits, '.', '_' or '-' "
            "(starting and ending with a letter or digit)"
        )
    return name


def parse_limit(option: str, value: str) -> tuple[str, int]:
    """``(Tenant field, value)`` of one ``weight=``/``max-inflight=``/``rpm=``/``tpm=`` option."""
    field_name, low, high = LIMIT_OPTIONS[option]
    if not _DIGITS.fullmatch(value) or not low <= int(value) <= high:
        raise TenantError(f"{option}= must be an integer from {low} to {high}")
    return field_name, int(value)


class TenantBook:
    """Collects tenants from key lines; the first line stating a value fixes it."""

    def __init__(self) -> None:
        self._stated: dict[str, dict[str, int]] = {}

    def add(self, name: str, limits: dict[str, int]) -> None:
        """Record one key line's tenant and the limits it states (TenantError on a conflict)."""
        stated = self._stated.setdefault(name, {})
        for field_name, value in limits.items():
            if stated.setdefault(field_name, value) != value:
                option = next(o for o, spec in LIMIT_OPTIONS.items() if spec[0] == field_name)
                raise TenantError(
                    f"tenant {name!r} has {option}={stated[field_name]} on an earlier line"
                )

    def tenants(self) -> dict[str, Tenant]:
        book = {
            name: Tenant(
                name,
                weight=limits.get("weight", 1),
                max_inflight=limits.get("max_inflight"),
                requests_per_minute=limits.get("requests_per_minute"),
                tokens_per_minute=limits.get("tokens_per_minute"),
            )
            for name, limits in self._stated.items()
        }
        book.setdefault(DEFAULT_TENANT, DEFAULT)
        return book


# The tenant's name as the engine's cache salt, set on the request by ``tenant_gate`` and sent by
# the proxy in ``contracts.headers.CACHE_SALT_HEADER``.
CACHE_SALT = web.RequestKey("cache_salt", str)
# The caller's tenant, set by ``tenant_gate``: admission queues the request at its tenant's fair
# share within its level (``fair_share.py``).
TENANT = web.RequestKey("tenant", Tenant)
# The last bytes of a streamed answer (proxy.py's ``SseEnding.tail``), where the usage event of a
# stream with ``stream_options.include_usage`` sits: read by ``tenant_gate`` to count its tokens.
STREAM_TAIL = web.ResponseKey("stream_tail", bytes)
