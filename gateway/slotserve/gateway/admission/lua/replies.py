"""Each Lua script's reply, parsed into a typed value (the scripts' ``return`` tables).

The Redis clients decode replies (``decode_responses``): texts arrive as ``str``, Lua numbers as
``int``. A script that refused its arguments replies ``{'invalid', what}`` whatever its own
shape (:func:`is_invalid`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

from slotserve.gateway.admission.types import CancelOutcome

DispatchStatus = Literal["ok", "full", "level_full", "deadline", "unfit"]
# Where a dispatching script's grants to the caller start in its reply (after the fixed fields).
_FIRST_GRANT = 6


def _int(value: object) -> int:
    if isinstance(value, int | str | bytes):
        return int(value)
    raise TypeError(f"a script replied {value!r} where a number belongs")


def is_invalid(reply: object) -> bool:
    """Whether the script refused a value before its first write (``{'invalid', what}``)."""
    return isinstance(reply, list) and reply[:1] == ["invalid"]


def invalid_name(reply: Sequence[object]) -> str:
    """What an invalid reply names as the refused value."""
    return str(reply[1]) if len(reply) > 1 else "?"


def dispatch_grants(reply: Sequence[object]) -> list[tuple[str, str]]:
    """The caller's own grants in a dispatching script's reply: (request id, endpoint) pairs,
    the endpoint empty for a refusal (``types.REFUSED``). Reads no number, so it cannot fail."""
    return [(str(reply[i]), str(reply[i + 1])) for i in range(_FIRST_GRANT, len(reply) - 1, 2)]


@dataclass(frozen=True)
class DispatchReply:
    """``{status, queue depth, dispatched so far, hold (us), epoch, retry after (us),
    grants...}`` of enqueue, release and tick (``prelude.py``'s ``result``)."""

    status: DispatchStatus
    queue_depth: int
    num_dispatched_total: int
    hold_us: int  # how long dispatching waits for the epoch's leases to come back
    epoch: str
    retry_after_us: int  # full, level_full, deadline: when to come back
    grants: list[tuple[str, str]]

    @classmethod
    def parse(cls, reply: Sequence[object]) -> DispatchReply:
        return cls(
            status=cast(DispatchStatus, str(reply[0])),
            queue_depth=_int(reply[1]),
            num_dispatched_total=_int(reply[2]),
            hold_us=_int(reply[3]),
            epoch=str(reply[4]),
            retry_after_us=_int(reply[5]),
            grants=dispatch_grants(reply),
        )


def cancel_outcome(reply: Sequence[object]) -> CancelOutcome:
    """``{'cancelled' | 'granted' | 'gone', endpoint}`` of cancel."""
    state = str(reply[0])
    if state not in ("cancelled", "granted", "gone"):
        raise ValueError(f"cancel replied {state!r}")
    return CancelOutcome(cast(Literal["cancelled", "granted", "gone"], state), str(reply[1]))


@dataclass(frozen=True)
class HeartbeatReply:
    """``{was alive (0/1), epoch id, us until it dispatches}`` of heartbeat."""

    was_alive: bool
    epoch: str
    wait_us: int

    @classmethod
    def parse(cls, reply: Sequence[object]) -> HeartbeatReply:
        return cls(bool(_int(reply[0])), str(reply[1]), _int(reply[2]))


@dataclass(frozen=True)
class TakeReply:
    """``{'ok', 0} | {reason, wait ms} | {'zero_quota', 0} | {'invalid', 0}`` of the quota
    take; ``reason`` names the limit that refused (``quotas.QuotaRefusal``)."""

    reason: str
    wait_ms: int

    @classmethod
    def parse(cls, reply: Sequence[object]) -> TakeReply:
        return cls(str(reply[0]), _int(reply[1]))
