"""Values and errors shared by the admission front (``admission.py``) and its two backends."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from slotserve.contracts.pool_spec import (
    MAX_PRIORITY_LEVELS,
    AdmissionSpec,
    TimeoutAction,
)
from slotserve.gateway.routing import EndpointOffer

# Internal priority for a request retried after its engine failed: ahead of every client level.
RETRY_PRIORITY = 0
# Priority aging: this much waiting (us) is worth one priority level (see ``enqueue``).
DEFAULT_AGING_US = 2_000_000
# Added to a demoted (DELAY) request's queue score: behind everything not demoted (~31 years of
# arrival time), order among the demoted kept; scores stay exact in a double (< 2**53 us).
DEMOTION_OFFSET_US = 1_000_000_000_000_000


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


class BackendUnavailableError(AdmissionError):
    status = 503
    code = "admission_backend_unavailable"


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
