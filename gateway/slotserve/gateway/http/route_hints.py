"""A request's route (prefix-aware routing, docs/gateway.md): read from its body and headers
before it queues, by the pool's ``routing`` block.

Its prefix keys are the ones the engines compute for their rows (``contracts.prefix_keys``),
under the same salt (the tenant, then the body's ``cache_salt``), so a tenant's request never
matches another tenant's rows. Its session key (the pool's ``sessionHeader``, else OpenAI's
``user`` field) reaches Redis only as a salted hash; a header longer than
``MAX_SESSION_KEY_CHARS`` is refused (400), a ``user`` field of any length is only hashed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from slotserve.contracts.pool_spec import MAX_SESSION_KEY_CHARS, RoutingSpec
from slotserve.contracts.prefix_keys import request_chain, salt_of
from slotserve.gateway.pools.engines import EngineMonitor
from slotserve.gateway.pools.routing import SESSION_HEX, Route, cache_wait_ms


class SessionKeyError(ValueError):
    """A session header no client needs: refused with 400."""


def session_id(
    routing: RoutingSpec, headers: Mapping[str, str], payload: Mapping[str, Any], salt: str
) -> str:
    """The request's session as ``SESSION_HEX`` hex digits ("" none)."""
    raw: object = headers.get(routing.session_header) if routing.session_header else None
    if raw is not None and len(str(raw)) > MAX_SESSION_KEY_CHARS:
        raise SessionKeyError(
            f"header {routing.session_header} is longer than {MAX_SESSION_KEY_CHARS} characters"
        )
    if raw is None and routing.session_from_user:
        raw = payload.get("user")
    if not isinstance(raw, str) or not raw:
        return ""
    digest = hashlib.blake2b(digest_size=SESSION_HEX // 2)
    digest.update(salt.encode("utf-8", "replace") + b"\x00")
    digest.update(raw.encode("utf-8", "replace"))
    return digest.hexdigest()


def route_of(
    routing: RoutingSpec,
    monitor: EngineMonitor,
    model: str,
    chat: bool,
    headers: Mapping[str, str],
    payload: Mapping[str, Any],
    tenant_salt: str,
) -> Route | None:
    """The request's route, or None (by load only: routing off, or nothing to prefer by)."""
    client_salt = payload.get("cache_salt")
    salt = salt_of(tenant_salt, client_salt if isinstance(client_salt, str) else None)
    session = session_id(routing, headers, payload, salt)
    keys = request_chain(chat, payload, salt).keys if routing.prefix_aware else ()
    if not keys and not session:
        return None
    depths = monitor.prefix_depths(model, keys)
    wait_ms = 0
    if routing.prefix_aware:
        wait_ms = cache_wait_ms(
            routing.cache_wait_milliseconds,
            routing.cache_wait_turnovers,
            monitor.offers(model),
            dict(depths),
        )
    return Route(
        keys=keys,
        depths=depths,
        session=session,
        balance_permille=round(routing.balance_threshold * 1000),
        wait_ms=wait_ms,
        look_ahead=routing.look_ahead,
    )
