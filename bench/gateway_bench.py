"""Gateway benchmark: added latency vs calling the engine directly, and admission throughput.

Everything runs on this machine: a fast engine double (tests/gateway/gateway_engine_double.py,
no generation, answers at once), one real redis-server, gateway processes.

1. Added latency: the same small completion sent one at a time, alternating between the engine
   double directly and through a gateway (in-process admission, and Redis admission), so both
   see the same machine noise. Added = gateway percentile - direct percentile.
2. Admission throughput, two ways:
   - admission only: acquire + release against Redis (no HTTP), per replica process and with
     3 replica processes at once, and per replica with every request routed by prefix and
     session (``_routed``: the dispatch reads and records the prefix index), and with requests
     queued for 16 slots, each routed to one engine's prefix (``_queued``: heads wait for their
     engines and others pass them);
   - end to end over HTTP: requests through 1 and 3 gateway replicas to the fast double.

    .venv/bin/python bench/gateway_bench.py [--requests 400] [--seconds 4] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from bench.lib.services import RedisServer, free_port, http_ok, wait_until

ROOT = Path(__file__).resolve().parents[1]

DOUBLE = ROOT / "tests" / "gateway" / "gateway_engine_double.py"
SLOTSERVE = ROOT / ".venv" / "bin" / "slotserve"
PAYLOAD = {"model": "m", "prompt": "hello", "max_tokens": 4, "x_delay": 0}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], url: str, env: dict | None = None) -> str:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.procs.append(proc)
        wait_until(lambda: http_ok(url), 20, what=url)
        return url.rsplit("/", 1)[0]

    def double(self, slots: int) -> str:
        port = free_port()
        argv = [
            sys.executable,
            str(DOUBLE),
            "--port",
            str(port),
            "--slots",
            str(slots),
            "--delay",
            "0",
            "--model",
            "m",
        ]
        return self.start(argv, f"http://127.0.0.1:{port}/health")

    def gateway(self, pool_file: Path, redis_url: str | None) -> str:
        port = free_port()
        argv = [
            str(SLOTSERVE),
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--config",
            str(pool_file),
            "--log-level",
            "WARNING",
        ]
        if redis_url:
            argv += ["--redis-url", redis_url]
        return self.start(argv, f"http://127.0.0.1:{port}/ready")

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def latency(direct: str, gateways: dict[str, str], num_requests: int) -> dict:
    samples: dict[str, list[float]] = {"direct": [], **{name: [] for name in gateways}}
    targets = {"direct": direct, **gateways}
    async with aiohttp.ClientSession() as s:
        for _ in range(20):  # warm connections
            for url in targets.values():
                async with s.post(f"{url}/v1/completions", json=PAYLOAD) as r:
                    await r.read()
        for _ in range(num_requests):
            for name, url in targets.items():
                started = time.perf_counter()
                async with s.post(f"{url}/v1/completions", json=PAYLOAD) as r:
                    await r.read()
                    assert r.status == 200, r.status
                samples[name].append((time.perf_counter() - started) * 1000)
    out = {}
    for name, values in samples.items():
        out[name] = {"p50_ms": statistics.median(values), "p99_ms": percentile(values, 0.99)}
    for name in gateways:
        out[name]["added_p50_ms"] = out[name]["p50_ms"] - out["direct"]["p50_ms"]
        out[name]["added_p99_ms"] = out[name]["p99_ms"] - out["direct"]["p99_ms"]
    return out


async def http_throughput(urls: list[str], seconds: float, concurrency: int) -> float:
    done = 0
    stop_at = time.monotonic() + seconds

    async def worker(i: int, s: aiohttp.ClientSession) -> None:
        nonlocal done
        url = urls[i % len(urls)]
        while time.monotonic() < stop_at:
            async with s.post(f"{url}/v1/completions", json=PAYLOAD) as r:
                await r.read()
                if r.status == 200:
                    done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        started = time.monotonic()
        await asyncio.gather(*(worker(i, s) for i in range(concurrency)))
        return done / (time.monotonic() - started)


def _admission_worker(
    redis_url: str,
    prefix: str,
    seconds: float,
    concurrency: int,
    queue,
    routed: bool = False,
    queued: bool = False,
) -> None:
    from slotserve.gateway.admission.backends.redis import RedisBackend
    from slotserve.gateway.admission.front import Admission
    from slotserve.gateway.admission.types import PoolPolicy
    from slotserve.gateway.pools import routing
    from slotserve.gateway.pools.routing import EndpointOffer

    # routed: every request carries a route as a 4-turn chat does (8 prefix keys, one engine's
    # match, a session, the pool's default wait for a full engine), so the dispatch reads and
    # records the prefix index (issue 29).
    hold_s = 0.002  # how long a queued run's request holds its slot
    slots = 4 if queued else 64
    offers = [EndpointOffer(f"http://e{i}", slots, 0.0, hold_s) for i in range(4)]
    route = None
    if routed:
        from slotserve.contracts.pool_spec import RoutingSpec
        from slotserve.contracts.prefix_keys import chat_chain

        messages = [{"role": "user", "content": f"turn {i}"} for i in range(8)]
        keys = chat_chain(messages, "bench").keys
        spec = RoutingSpec()
        route = routing.Route(
            keys=keys,
            depths=(("http://e1", 6),),
            session="ab" * 16,
            wait_ms=routing.cache_wait_ms(
                spec.cache_wait_milliseconds, spec.cache_wait_turnovers, offers, {"http://e1": 6}
            ),
            look_ahead=spec.look_ahead,
        )

    # queued: 4 engines of 4 slots, each request held 2 ms and routed to one engine's prefix
    # (worker i to engine i % 4), so requests queue, heads wait for their engines and others pass
    # them (docs/gateway.md, waiting for the engine that holds the prefix).
    routes = [route] * concurrency
    if queued:
        from slotserve.contracts.pool_spec import RoutingSpec
        from slotserve.contracts.prefix_keys import chat_chain

        spec = RoutingSpec()
        routes = []
        for i in range(concurrency):
            turns = [{"role": "user", "content": f"c{i} t{t}"} for t in range(8)]
            routes.append(
                routing.Route(
                    keys=chat_chain(turns, "bench").keys,
                    depths=((f"http://e{i % 4}", 6),),
                    wait_ms=routing.cache_wait_ms(
                        spec.cache_wait_milliseconds,
                        spec.cache_wait_turnovers,
                        offers,
                        {f"http://e{i % 4}": 6},
                    ),
                    look_ahead=spec.look_ahead,
                )
            )

    async def run() -> int:
        backend = RedisBackend(redis_url, f"bench-{os.getpid()}", prefix=prefix)
        pool = PoolPolicy("m", max_queue_size=100_000, queue_timeout_s=30)
        admission = Admission(backend, lambda _: offers, lambda: [pool])
        await admission.start()
        done = 0
        errors: list[str] = []
        stop_at = time.monotonic() + seconds

        async def worker(index: int) -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                try:
                    lease = await admission.acquire(pool, 5, 30, route=routes[index])
                except Exception as exc:  # counted, not fatal: the run reports it
                    errors.append(repr(exc)[:120])
                    await asyncio.sleep(0.05)
                    continue
                if queued:
                    await asyncio.sleep(hold_s)
                await admission.release(lease)
                done += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        await admission.close()
        if errors:
            print(f"admission worker: {len(errors)} errors, first: {errors[0]}", flush=True)
        return done

    queue.put(asyncio.run(run()))


def admission_throughput(
    redis_url: str,
    num_procs: int,
    seconds: float,
    concurrency: int,
    routed: bool = False,
    queued: bool = False,
) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    prefix = f"bench{time.monotonic_ns()}"
    args = (redis_url, prefix, seconds, concurrency, queue, routed, queued)
    procs = [ctx.Process(target=_admission_worker, args=args) for _ in range(num_procs)]
    for p in procs:
        p.start()
    total = sum(queue.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    return total / seconds


def redis_ping_us(redis_url: str, num: int = 2000) -> float:
    """Round trip of a bare PING from this process: how busy the machine is right now."""
    import redis.asyncio as aioredis

    async def run() -> float:
        client = aioredis.Redis.from_url(redis_url)
        await client.ping()
        started = time.perf_counter()
        for _ in range(num):
            await client.ping()
        elapsed = time.perf_counter() - started
        await client.aclose()
        return elapsed / num * 1e6

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="latency samples per target")
    parser.add_argument("--seconds", type=float, default=4.0, help="per throughput run")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gateway_bench.json")
    args = parser.parse_args()
    procs = Procs()
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        try:
            engine = procs.double(slots=256)
            pool_file = Path(tmp) / "pools.yaml"
            pool_file.write_text(
                yaml.safe_dump(
                    {
                        "pools": [
                            {
                                "model": "m",
                                "endpoints": [engine],
                                "admission": {"maxQueueSize": 100000},
                            }
                        ]
                    }
                )
            )
            gw_memory = procs.gateway(pool_file, None)
            gw_redis = [procs.gateway(pool_file, redis.url) for _ in range(3)]
            lat = asyncio.run(
                latency(
                    engine,
                    {"gateway_inprocess": gw_memory, "gateway_redis": gw_redis[0]},
                    args.requests,
                )
            )
            ping_us = redis_ping_us(redis.url)
            thr = {
                "admission_only_1_replica": admission_throughput(
                    redis.url, 1, args.seconds, args.concurrency
                ),
                "admission_only_3_replicas": admission_throughput(
                    redis.url, 3, args.seconds, args.concurrency
                ),
                "admission_only_1_replica_routed": admission_throughput(
                    redis.url, 1, args.seconds, args.concurrency, routed=True
                ),
                "admission_only_1_replica_queued": admission_throughput(
                    redis.url, 1, args.seconds, args.concurrency, queued=True
                ),
                "http_direct_engine": asyncio.run(
                    http_throughput([engine], args.seconds, args.concurrency)
                ),
                "http_1_replica_inprocess": asyncio.run(
                    http_throughput([gw_memory], args.seconds, args.concurrency)
                ),
                "http_1_replica_redis": asyncio.run(
                    http_throughput(gw_redis[:1], args.seconds, args.concurrency)
                ),
                "http_3_replicas_redis": asyncio.run(
                    http_throughput(gw_redis, args.seconds, args.concurrency)
                ),
            }
        finally:
            procs.stop()
            redis.stop()
    header = ["p50 ms", "p99 ms", "added p50", "added p99"]
    print(f"{'latency (sequential)':<28}" + "".join(f"{h:>11}" for h in header))
    for name, row in lat.items():
        values = [
            row["p50_ms"],
            row["p99_ms"],
            row.get("added_p50_ms", 0),
            row.get("added_p99_ms", 0),
        ]
        print(f"{name:<28}" + "".join(f"{v:>11.2f}" for v in values))
    print()
    print(f"{'throughput':<28}{'req/s':>10}")
    for name, value in thr.items():
        print(f"{name:<28}{value:>10.0f}")
    print(f"\ncalibration: Redis PING round trip {ping_us:.0f} us, load average {os.getloadavg()}")
    result = {
        "redis_ping_us": ping_us,
        "load_average": os.getloadavg(),
        "latency": lat,
        "throughput_per_s": thr,
        "requests": args.requests,
        "seconds": args.seconds,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
