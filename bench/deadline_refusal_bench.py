"""Deadline-aware refusal: how often a request refused at once would indeed have timed out.

The gateway's admission (``Admission`` over the in-process backend, whose steps the fuzz holds
equal to the Redis scripts) in front of a pool of ``--slots`` slots; each admitted request holds
its slot for a service time drawn uniformly from 0.5x to 1.5x ``--service-s`` (as answers'
lengths vary), then releases it. Requests arrive Poisson at ``--load`` times the capacity, each
with a deadline (``x-slotserve-deadline-ms``) drawn uniformly from ``--deadline-min-s`` to
``--deadline-max-s``.

Two runs on the same arrivals, side by side:

- shadow (refusal off): after every enqueue that had to wait, the prediction the refusal would
  make (``predicted_wait_us`` of the places ahead, at the measured drain) is recorded; the
  request then waits as ever. Precision: the share of the requests it would have refused that
  did time out; recall: the share of the timeouts it would have refused.
- refusal on: refused at once (429 deadline), timed out in the queue (503), served, and the
  place-seconds that timed-out requests held in the queue.

    .venv/bin/python bench/deadline_refusal_bench.py [--seconds 20] [--slots 4] [--load 1.3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotserve.gateway.admission.backends.memory import InProcessBackend, InProcessHub
from slotserve.gateway.admission.drain import wait_gap_us
from slotserve.gateway.admission.front import Admission
from slotserve.gateway.admission.types import (
    DeadlineUnreachableError,
    PoolPolicy,
    QueueFullError,
    QueueTimeoutError,
    predicted_wait_us,
)
from slotserve.gateway.pools.routing import EndpointOffer

ROOT = Path(__file__).resolve().parent
POOL = "m"
WARMUP_S = 3.0  # the drain is measured from the first seconds: requests before are not counted

_request: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("request")


class ShadowBackend(InProcessBackend):
    """The in-process backend, recording after each enqueue what the refusal would decide."""

    admission: Admission | None = None

    async def enqueue(self, pool: PoolPolicy, *args: Any, **kwargs: Any) -> Any:
        result = await super().enqueue(pool, *args, **kwargs)
        request_id, priority, timeout_us = args[1], args[2], args[3]
        state = self.hub.pool(pool.name)
        cell = _request.get(None)
        if cell is not None and self.admission is not None and request_id in state.queue:
            gap = wait_gap_us(self.admission.service_rate(pool.name))
            if gap:
                ahead = state.places_ahead(request_id, priority)
                cell["would_refuse"] = predicted_wait_us(ahead, gap) > timeout_us
        return result


@dataclass
class Run:
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    timed_out_place_s: float = 0.0


async def run(args: argparse.Namespace, refuse: bool, seed: int) -> Run:
    hub = InProcessHub(lease_ttl_s=10.0)
    backend = ShadowBackend(hub, "bench")
    pool = PoolPolicy(POOL, max_queue_size=10_000, queue_timeout_s=30)
    offers = [EndpointOffer("http://engine", args.slots, 0.0)]
    admission = Admission(
        backend,
        offers=lambda name: offers,
        pools=lambda: [pool],
        tick_interval_s=0.05,
        deadline_refusal=refuse,
    )
    backend.admission = admission
    await admission.start()
    rng = random.Random(seed)
    out = Run()
    started = time.monotonic()

    async def request(deadline_s: float, service_s: float) -> None:
        cell: dict[str, Any] = {"would_refuse": False, "deadline_s": deadline_s}
        _request.set(cell)
        arrived = time.monotonic()
        counted = arrived - started >= WARMUP_S
        try:
            lease = await admission.acquire(pool, priority=5, timeout_s=deadline_s)
        except DeadlineUnreachableError:
            cell["outcome"] = "refused"
        except QueueTimeoutError:
            cell["outcome"] = "timed_out"
            out.timed_out_place_s += (time.monotonic() - arrived) * counted
        except QueueFullError:
            cell["outcome"] = "full"
        else:
            cell["outcome"] = "served"
            cell["wait_s"] = lease.queue_wait_s
            await asyncio.sleep(service_s)
            await admission.release(lease)
        if counted:
            out.outcomes.append(cell)

    mean_gap_s = args.service_s / args.slots / args.load
    tasks = []
    while time.monotonic() - started < args.seconds:
        deadline_s = rng.uniform(args.deadline_min_s, args.deadline_max_s)
        service_s = args.service_s * rng.uniform(0.5, 1.5)
        tasks.append(asyncio.create_task(request(deadline_s, service_s)))
        await asyncio.sleep(rng.expovariate(1 / mean_gap_s))
    await asyncio.gather(*tasks)
    await admission.close()
    return out


def summary(result: Run) -> dict[str, Any]:
    outcomes = result.outcomes
    count = {k: sum(o["outcome"] == k for o in outcomes) for k in ("served", "timed_out")}
    count["refused"] = sum(o["outcome"] == "refused" for o in outcomes)
    predicted = [o for o in outcomes if o["would_refuse"]]
    hits = sum(o["outcome"] == "timed_out" for o in predicted)
    waits = sorted(o["wait_s"] for o in outcomes if "wait_s" in o)
    return {
        "requests": len(outcomes),
        **count,
        "would_refuse": len(predicted),
        "precision": hits / len(predicted) if predicted else None,
        "recall": hits / count["timed_out"] if count["timed_out"] else None,
        "served_wait_p50_s": waits[len(waits) // 2] if waits else None,
        "timed_out_place_s": round(result.timed_out_place_s, 1),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    shadow = summary(await run(args, refuse=False, seed=args.seed))
    refusing = summary(await run(args, refuse=True, seed=args.seed))
    return {"shadow": shadow, "refusal": refusing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="arrivals per run")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--service-s", type=float, default=0.2, help="mean service time")
    parser.add_argument("--load", type=float, default=1.3, help="arrival rate / capacity")
    parser.add_argument("--deadline-min-s", type=float, default=0.2)
    parser.add_argument("--deadline-max-s", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "results" / "deadline_refusal_bench.json"
    )
    args = parser.parse_args()
    figures = asyncio.run(main_async(args))
    load = os.getloadavg()
    for name, row in figures.items():
        print(
            f"{name:8s} "
            + " ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            )
        )
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "load_average": load, **figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
