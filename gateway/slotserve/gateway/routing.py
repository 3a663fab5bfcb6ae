"""Pure routing rules: which endpoint gets the next request.

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
    need: int = 1,
) -> list[EndpointOffer]:
    """Endpoints with ``need`` free slots (a request's ``n``), least loaded first.

    Load is first the share of slots the gateways hold in flight (exact and current, shared by all
    replicas), then the engine's own report, then the URL so that every replica agrees. Every
    batching policy is routed alike: the engine forms static and dynamic batches itself from what
    arrives, so the gateway never holds a request back while an endpoint has room for it.
    """
    eligible = [offer for offer in offers if inflight.get(offer.url, 0) + need <= offer.slots_total]
    return sorted(
        eligible,
        key=lambda o: (inflight.get(o.url, 0) / o.slots_total, o.load_score, o.url),
    )
