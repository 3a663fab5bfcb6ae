"""Each Lua script's own arguments, one frozen dataclass per script, field order = ARGV order.

A dispatching script's own arguments follow the shared ones (``redis_keys.DispatchArgs``) and
the offers, from the index ``REST``; the others' start at ARGV[1]. ``argv()`` builds them and
``lua_args`` (``redis_keys.ScriptArgs``) binds them in the script to ``ARG_<FIELD>`` locals, each
the text as passed, checked by the script before its first write (``values.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slotserve.contracts.redis_keys import ScriptArgs


@dataclass(frozen=True)
class EnqueueArgs(ScriptArgs):
    request_id: str
    priority: int
    timeout_us: int
    max_queue_size: int  # the pool's
    only_if_absent: bool
    drain_gap_us: int  # expected gap between two places freeing (1 / measured drain rate)
    queue_timeout_us: int  # how far ahead return times are promised to rejected clients
    aging_us: int  # waiting worth one priority level
    level_max_queue_size: int  # the request's level's own
    demote_after_us: int  # when (from now) the request is demoted (DELAY; 0: never)
    slots: int  # the slots it takes (its ``n``)
    tenant: str
    weight: int  # its tenant's (``fair.py``)
    deadline_gap_us: int  # predicts its wait for a deadline-aware refusal (0: none)
    route: str = ""  # ``routing.Route.encode`` ("" none: the least loaded engine)


@dataclass(frozen=True)
class ReleaseArgs(ScriptArgs):
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class CancelArgs(ScriptArgs):
    request_id: str


@dataclass(frozen=True)
class TickArgs(ScriptArgs):
    """None: the tick takes the shared arguments and the offers only."""


@dataclass(frozen=True)
class HeartbeatArgs(ScriptArgs):
    prefix: str
    caller: str
    lease_ttl_us: int
    state_ttl_ms: int
    known_epoch: str  # "" if none yet
    restore: bool  # write back the leases Redis lost
    leases: tuple[str | int, ...]  # per pool: name, N, N triples (request id, endpoint, slots)


def heartbeat_leases(leases: Mapping[str, Sequence[tuple[str, str, int]]]) -> tuple[str | int, ...]:
    """``HeartbeatArgs.leases`` from each pool's (request id, endpoint, slots) triples."""
    out: list[str | int] = []
    for pool_name, held in leases.items():
        out += [pool_name, len(held)]
        for request_id, endpoint, slots in held:
            out += [request_id, endpoint, slots]
    return tuple(out)


@dataclass(frozen=True)
class TakeArgs(ScriptArgs):
    """The quota ``take`` (``quotas.py``); a limit of -1 is none."""

    request_id: str
    max_inflight: int
    requests_per_minute: int
    tokens_per_minute: int
    cost_tokens: int
    inflight_ttl_ms: int


@dataclass(frozen=True)
class ChargeArgs(ScriptArgs):
    tokens_per_minute: int
    tokens: int  # negative: given back


@dataclass(frozen=True)
class RefreshArgs(ScriptArgs):
    inflight_ttl_ms: int
    request_ids: tuple[str, ...]  # each still held is kept for another TTL
