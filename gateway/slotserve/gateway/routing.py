"""Pure routing rules: which endpoint gets the next request, and how big a released group is.

The Redis backend runs the same rules inside its Lua scripts (``lua.py``); the shared
admission test suite checks that both backends agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EndpointOffer:
    """An endpoint that may receive requests, as this gateway replica last saw it."""

    url: str
    slots_total: int
    load_score: float
    # The engine's recent mean seconds a request holds a slot (its /load; 0: none finished).
    mean_request_s: float = 0.0


def load_score(running: int, waiting: int, kv_cache_usage: float, slots_total: int) -> float:
    """Engine-reported load as one number, lower is better.

    Queued work at the engine weighs double (it delays everything behind it); KV usage breaks
    ties between engines with the same number of sequences.
    """
    slots = max(slots_total, 1)
    return (running + 2 * waiting) / slots + kv_cache_usage


def rank_endpoints(
    offers: Sequence[EndpointOffer],
    inflight: Mapping[str, int],
    *,
    idle_only: bool = False,
    need: int = 1,
) -> list[EndpointOffer]:
    """Endpoints with ``need`` free slots (a request's ``n``), least loaded first.

    Load is first the share of slots the gateways hold in flight (exact and current, shared by all
    replicas), then the engine's own report, then the URL so that every replica agrees.
    """
    eligible = [
        offer
        for offer in offers
        if inflight.get(offer.url, 0) + need <= offer.slots_total
        and (not idle_only or inflight.get(offer.url, 0) == 0)
    ]
    return sorted(
        eligible,
        key=lambda o: (inflight.get(o.url, 0) / o.slots_total, o.load_score, o.url),
    )


def group_size(
    *,
    num_waiting: int,
    slots_total: int,
    preferred_batch_sizes: Sequence[int],
    waited_us: int,
    max_queue_delay_us: int,
) -> int:
    """How many waiting requests to release together to one idle endpoint (dynamic/static pools).

    Triton's dynamic batcher at the gateway: a full batch goes at once; otherwise the largest
    preferred size that is available; otherwise everything once the oldest request has waited
    ``max_queue_delay_us``. Zero means "hold the group a little longer".
    """
    if num_waiting <= 0:
        return 0
    if num_waiting >= slots_total:
        return slots_total
    fitting = [size for size in preferred_batch_sizes if size <= num_waiting]
    if fitting:
        return max(fitting)
    if waited_us >= max_queue_delay_us:
        return num_waiting
    return 0
