"""Values and errors shared by the admission front (``front.py``) and its two backends."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from slotserve.contracts.pool_spec import (
    MAX_PRIORITY_LEVELS,
    AdmissionSpec,
    TimeoutAction,
)
from slotserve.gateway.pools.routing import EndpointOffer, Route

# Internal priority for a request retried after its engine failed: ahead of every client level.
RETRY_PRIORITY = 0
# Priority aging: this much waiting (us) is worth one priority level (see ``enqueue``).
DEFAULT_AGING_US = 2_000_000
# Added to a demoted (DELAY) request's queue score: behind everything not demoted (~31 years of
# arrival time), order among the demoted kept; scores stay exact in a double (< 2**53 us).
DEMOTION_OFFSET_US = 1_000_000_000_000_000

# Bounds of every number a backend step takes (``check_enqueue``; the Lua scripts check the same
# before their first write, ``lua/scripts.py``). Nothing a client sends reaches a backend
# unchecked, and a value outside them is refused whole, never written half-way.
MAX_LEASE_SLOTS = 1024  # a lease's slots (a request's n): MaxBatchSize's bound, no engine has more
MAX_WAIT_US = 86_400_000_000  # a wait, aging step, drain gap or promise horizon: one day at most
MAX_QUEUE_SIZE = 1_000_000  # AdmissionSpec.max_queue_size's bound
# A place freed while clients were told to come back (429 + Retry-After) is held for one of them
# only while its return is at most this far ahead; at most 3/4 of the queue is ever held.
PROMISE_WINDOW_US = 5_000_000
# A tenant's weight (``tenants.MAX_WEIGHT``) and name (``tenants.TENANT_NAME``), as the fair share
# of a level takes them (``fair_share.py``, ``lua/fair.py``).
MAX_WEIGHT = 1000
TENANT_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
# A promise is kept by a return (an arrival that must wait) from its due time until this much
# later; past that its client is taken as gone: the promise lapses and no longer counts ahead
# of anyone in a Retry-After.
PROMISE_GRACE_US = 1_000_000
# Promises kept and lapsed are counted (both halved once their sum passes this): promises count
# ahead of a newcomer, and hold places, in the share that their clients lately came back.
PROMISE_MEMORY = 64
# The endpoint of a "grant" that refuses its request: no engine of the pool can ever hold its
# slots (``Admission._on_grant`` raises ``NoEngineFitsError`` in its waiter, nothing is held).
REFUSED = ""


@dataclass(frozen=True)
class LevelPolicy:
    """Triton's queue policy of one priority level, with the pool's values filled in."""

    max_queue_size: int
    queue_timeout_s: float
    timeout_action: TimeoutAction = "REJECT"


@dataclass(frozen=True)
class QueueWait:
    """How long one request may wait: demoted (``DELAY``) after ``demote_after_s``, given up
    (503) after ``give_up_after_s``; without demotion the two are equal."""

    demote_after_s: float
    give_up_after_s: float


@dataclass(frozen=True)
class PoolPolicy:
    """What the backends need to know about a pool to admit its requests."""

    name: str
    max_queue_size: int = 256
    queue_timeout_s: float = 30.0
    priority_levels: int = MAX_PRIORITY_LEVELS
    default_priority_level: int | None = None  # unset: the gateway's --default-priority
    # (level, its policy) for the levels that have their own; the rest use the pool's values.
    priority_queue_policy: tuple[tuple[int, LevelPolicy], ...] = ()
    priority_aging_s: float | None = None  # unset: the gateway's --priority-aging-seconds
    # A tenant under its share may preempt one over it when no slot is free (preempt_share.py).
    preempt_for_share: bool = True

    @classmethod
    def from_specs(cls, name: str, admission: AdmissionSpec) -> PoolPolicy:
        levels = tuple(
            (
                level,
                LevelPolicy(
                    spec.max_queue_size
                    if spec.max_queue_size is not None
                    else admission.max_queue_size,
                    spec.queue_timeout_seconds or admission.queue_timeout_seconds,
                    spec.timeout_action,
                ),
            )
            for level, spec in sorted(admission.priority_queue_policy.items())
        )
        return cls(
            name=name,
            max_queue_size=admission.max_queue_size,
            queue_timeout_s=admission.queue_timeout_seconds,
            priority_levels=admission.priority_levels,
            default_priority_level=admission.default_priority_level,
            priority_queue_policy=levels,
            priority_aging_s=admission.priority_aging_seconds,
            preempt_for_share=admission.preempt_for_share,
        )

    def level(self, priority: int) -> LevelPolicy:
        """The queue policy of ``priority`` (retries, level 0, use the pool's own values)."""
        for level, policy in self.priority_queue_policy:
            if level == priority:
                return policy
        return LevelPolicy(self.max_queue_size, self.queue_timeout_s)

    def queue_wait(self, priority: int, client_limit_s: float | None = None) -> QueueWait:
        """A request's waits at ``priority``. ``DELAY``: demoted at the level's timeout and
        given up after twice that; a client's own limit only ever shortens the wait."""
        level = self.level(priority)
        give_up_s = level.queue_timeout_s
        if level.timeout_action == "DELAY":
            give_up_s *= 2
        if client_limit_s is not None:
            give_up_s = min(give_up_s, client_limit_s)
        return QueueWait(min(level.queue_timeout_s, give_up_s), give_up_s)


@dataclass(frozen=True)
class DispatchResult:
    """What one atomic backend step did, as seen by the calling replica (its grants, this
    replica's included, went to the replicas' ``on_grant`` callbacks as the step finished)."""

    queue_depth: int = 0
    num_dispatched_total: int = 0
    # > 0: the admission epoch is not ready yet (Redis lost its data); dispatch again after this
    # many microseconds.
    hold_us: int = 0
    # The backend lost its state since this replica last wrote its leases (Redis FLUSHALL,
    # restart or failover): the replica must write them back and requeue its waiters at once.
    state_lost: bool = False


@dataclass(frozen=True)
class CancelOutcome:
    """Result of taking a timed-out request out of the queue."""

    state: Literal["cancelled", "granted", "gone"]
    endpoint: str = ""


class AdmissionError(Exception):
    """A request was not admitted; carries what the HTTP layer needs to answer."""

    status = 503
    code = "admission_error"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class QueueFullError(AdmissionError):
    status = 429
    code = "queue_full"

    def __init__(
        self, message: str, *, queue_depth: int, num_dispatched_total: int, retry_after_s: int
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.queue_depth = queue_depth
        self.num_dispatched_total = num_dispatched_total


class QueueTimeoutError(AdmissionError):
    status = 503
    code = "queue_timeout"


class DeadlineUnreachableError(AdmissionError):
    """The predicted wait (the places ahead of it, at the measured drain) is longer than the
    request may wait (its deadline header or the queue timeout): refused at once instead of timing
    out in the queue after holding a place (``--deadline-refusal``)."""

    status = 429
    code = "deadline"

    @classmethod
    def of(cls, pool_name: str, timeout_us: int, *, retry_after_s: int) -> DeadlineUnreachableError:
        return cls(
            f"the predicted queue wait in pool {pool_name!r} is longer than this request may "
            f"wait ({timeout_us / 1e6:.1f} s: its x-slotserve-deadline-ms or the queue timeout)",
            retry_after_s=retry_after_s,
        )


def predicted_wait_us(places_ahead: int, deadline_gap_us: int) -> int:
    """A queued request's predicted wait: one gap per place ahead of it and one for its own
    (the places ahead counted at most as far as any wait goes, so the product stays exact in a
    double; ``lua/scripts.py`` computes the same)."""
    return (min(places_ahead, MAX_WAIT_US // deadline_gap_us) + 1) * deadline_gap_us


class BackendUnavailableError(AdmissionError):
    status = 503
    code = "admission_backend_unavailable"


class InvalidAdmissionValueError(AdmissionError):
    """A value outside the backends' bounds (``check_enqueue``): refused before any write."""

    status = 400
    code = "invalid_value"


class NoEngineFitsError(AdmissionError):
    """The request reached the head of its queue and needs more slots (its ``n``) than any ready
    engine of the pool has: refused, so that it never blocks the requests behind it."""

    status = 400
    code = "invalid_value"

    @classmethod
    def of(cls, pool_name: str, slots: int, most_slots: int) -> NoEngineFitsError:
        return cls(
            f"'n' ({slots}) exceeds the slots of every ready engine of pool {pool_name!r} "
            f"(at most {most_slots}): each choice takes one"
        )


def check_enqueue(
    pool: PoolPolicy,
    priority: int,
    timeout_us: int,
    *,
    drain_gap_us: int,
    aging_us: int,
    demote_after_us: int | None,
    slots: int,
    tenant: str = "default",
    weight: int = 1,
    deadline_gap_us: int = 0,
) -> None:
    """Raise ``InvalidAdmissionValueError`` for any enqueue value outside the bounds; both
    backends call it first, and the Lua script repeats it (a caller's bug must not reach Redis)."""
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise InvalidAdmissionValueError(f"tenant must be a tenant's name, got {repr(tenant)[:80]}")
    bounds = {
        "priority": (priority, RETRY_PRIORITY, MAX_PRIORITY_LEVELS),
        "timeout_us": (timeout_us, 1, MAX_WAIT_US),
        "drain_gap_us": (drain_gap_us, 1, MAX_WAIT_US),
        "aging_us": (aging_us, 0, MAX_WAIT_US),
        "demote_after_us": (demote_after_us or 0, 0, MAX_WAIT_US),
        "slots": (slots, 1, MAX_LEASE_SLOTS),
        "weight": (weight, 1, MAX_WEIGHT),
        "deadline_gap_us": (deadline_gap_us, 0, MAX_WAIT_US),
        "max_queue_size": (pool.max_queue_size, 0, MAX_QUEUE_SIZE),
        "level max_queue_size": (pool.level(priority).max_queue_size, 0, MAX_QUEUE_SIZE),
        "queue_timeout_us": (promise_horizon_us(pool), 1, MAX_WAIT_US),
    }
    for name, (value, low, high) in bounds.items():
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidAdmissionValueError(
                f"{name} must be an integer between {low} and {high}, got {value!r}"
            )


def kept_share(num_promises: int, num_kept: int, num_lapsed: int) -> int:
    """``num_promises`` in the share of promises lately kept (rounded up; all of them before
    any has been kept or has lapsed): how many of their clients are expected back
    (``lua/scripts.py`` computes the same)."""
    return (num_promises * (num_kept + 1) + num_kept + num_lapsed) // (num_kept + num_lapsed + 1)


def promise_horizon_us(pool: PoolPolicy) -> int:
    """How far ahead places are promised to rejected clients: one queue timeout."""
    return max(1, int(pool.queue_timeout_s * 1_000_000))


GrantCallback = Callable[[str, str, str], None]  # (pool, request_id, endpoint)


class AdmissionBackend(Protocol):
    """Shared queue and slot state. Every method is one atomic step across all replicas.

    Every grant reaches its replica through that replica's ``on_grant`` callback as soon as the
    step is done, the calling replica's included and even if its caller was cancelled meanwhile
    (the client went away): so no grant is ever lost with a caller.
    """

    replica_id: str

    async def start(self, on_grant: GrantCallback) -> None: ...

    async def close(self) -> None: ...

    async def enqueue(
        self,
        pool: PoolPolicy,
        offers: Sequence[EndpointOffer],
        request_id: str,
        priority: int,
        timeout_us: int,
        *,
        drain_gap_us: int = 1_000_000,
        aging_us: int = DEFAULT_AGING_US,
        demote_after_us: int | None = None,
        only_if_absent: bool = False,
        slots: int = 1,
        tenant: str = "default",
        weight: int = 1,
        deadline_gap_us: int = 0,
        route: Route | None = None,
    ) -> DispatchResult:
        """Queue a request (raising QueueFullError beyond maxQueueSize, or beyond its level's
        own ``maxQueueSize``), then dispatch.

        ``demote_after_us`` (< ``timeout_us``; Triton's ``DELAY``): from then on the request
        stays queued but behind every request not demoted (order among the demoted kept);
        ``None``: never demoted, dropped at ``timeout_us``.

        Order: arrival time plus ``priority * aging_us``; so FIFO within a level, a lower level
        first, and a request that has waited ``aging_us`` longer than another counts one level
        higher: no level waits forever behind a stream of better ones.

        Places promised to clients rejected earlier count as taken until their Retry-After is
        over; a rejected client is promised the next place after them, ``drain_gap_us`` (one
        over the measured drain rate) later. ``only_if_absent``: do nothing if the request is
        already queued or holds a lease.

        ``slots``: the request's lease holds that many slots (one per choice, its ``n``); it is
        granted only an endpoint with that many free. A head that needs more than any endpoint
        has free waits, and everyone behind it at its level waits too (FIFO, no starvation of
        big requests).

        ``route``: what may prefer one engine for it (its cached prefix, its session:
        ``routing.pick_endpoint``); without one, the least loaded engine.

        ``tenant``/``weight``: within its level, the request's place follows its tenant's
        weighted fair share (start-time fair queuing, ``fair_share.py``): the queue's order
        picks the level whose turn it is, the fair tags pick who goes within it.

        ``deadline_gap_us`` > 0 (one over the measured drain rate): a request that has to wait
        and whose predicted wait (``predicted_wait_us`` of the places ahead of it: the entries
        of other levels ahead in the queue, and those of its level ahead in fair order) is
        longer than ``timeout_us`` is taken out again and refused with
        ``DeadlineUnreachableError``, Retry-After the excess; 0: never.
        """
        ...

    async def release(
        self, pool: PoolPolicy, offers: Sequence[EndpointOffer], request_id: str
    ) -> DispatchResult:
        """Give a lease back (idempotent), then dispatch."""
        ...

    async def cancel(self, pool: PoolPolicy, request_id: str) -> CancelOutcome: ...

    async def tick(self, pool: PoolPolicy, offers: Sequence[EndpointOffer]) -> DispatchResult:
        """Sweep expired leases and dead replicas' queue entries, then dispatch."""
        ...

    async def heartbeat(
        self, leases: dict[str, list[tuple[str, str, int]]], *, restore: bool
    ) -> bool:
        """Mark this replica alive and extend its leases ({pool: [(request_id, endpoint,
        slots)]}).

        With ``restore``, leases missing from the backend (it lost them) are written back.
        Returns whether the backend's view was intact: this replica was still alive (its
        heartbeat had not lapsed) and the backend kept its state (same admission epoch).
        """
        ...

    async def inflight(self, pool: PoolPolicy) -> dict[str, int]:
        """Slots held on each endpoint (a lease holds its request's ``n``)."""
        ...
