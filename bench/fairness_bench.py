"""Fairness benchmark: a tenant that floods a pool against one that asks for its share.

Everything runs on this machine: real ``slotserve engine`` processes (``--engine real``, the
default: ``--model`` smollm2, ``--slots`` slots, ``--num-threads`` each), one real redis-server,
gateway processes (3 on Redis, 1 in-process), the keys file declaring the tenants. Each answer
asks for a number of new tokens drawn uniform from 0.5x to 1.5x ``--new-tokens`` (with
``ignore_eos``), so service times vary as answers' lengths do. The pool's capacity is measured
first: ``--slots`` closed-loop clients straight to the engine for ``--capacity-seconds``.
``--engine double`` runs the engine double instead (tests/gateway/gateway_engine_double.py: each
answer after 0.5x to 1.5x ``--service-s``; capacity slots / service_s). Requests go round-robin
to the gateways:

- tenant B at its share: Poisson arrivals at ``--load-b`` (0.8) of its share of the capacity
  (share = its share of the slots, from weight_b / (weight_a + weight_b));
- tenant A floods: closed-loop clients (send, wait for the answer, send again), ``--flood`` (10)
  times as many as its share of the slots: a backlog always waits.

Four runs per backend, side by side: B beside A where A keeps to its share (closed-loop clients
as many as its share of the slots, so B has its share's slots to itself on the same engine,
stepping at the same speed as under the flood: what its share promises it, and the reference its
flood wait is compared with); B alone on the whole pool; B under A's flood with A and B as
tenants (weighted fair share); and the same flood with both keys in one tenant (first come,
first served: what a gateway without tenants does). A separate engine of the share's slots is no
reference on a real model: its steps are shorter, so at the same load its queue is another one.
Each answer's queue wait is the gateway's own ``x-slotserve-queue-wait-ms``; slot use is the
engine's ``/load`` (1 - slots_free / slots_total: slots held by a request) sampled every 20 ms.

``--preempt on`` (the pool's ``preemptForShare``, issue 26): a request of B while B holds fewer
slots than its share, or (B light, A backlogged) as many, may preempt one of A's running answers
(docs/gateway.md, "Preemption for a tenant under its share"); each run then also reports the
engine's tenant preemptions (answers preempted) and the computed tokens they lost (recomputed).
``--phases`` runs a subset of the four runs (``share flood`` is what the target compares).

    .venv/bin/python bench/fairness_bench.py [--seconds 60] [--slots 4] [--new-tokens 64]
    .venv/bin/python bench/fairness_bench.py --preempt off --phases share flood
    .venv/bin/python bench/fairness_bench.py --engine double [--service-s 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.lib.output import line_buffered_stdout
from bench.lib.services import RedisServer, ServerProcess, free_port, http_ok, wait_until
from slotserve.models.resolve import resolve_model
from slotserve.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DOUBLE = ROOT / "tests" / "gateway" / "gateway_engine_double.py"
SLOTSERVE = ROOT / ".venv" / "bin" / "slotserve"
QUEUE_WAIT_HEADER = "x-slotserve-queue-wait-ms"
# Keys: A and B as tenants of their own, and both in one tenant (the first-come baseline).
SHARE = "B at its share, A at its share"  # the reference: what B's share promises it
FLOOD = "flood, tenants"
PHASES = {
    "share": SHARE,
    "alone": "B alone, whole pool",
    "flood": FLOOD,
    "one": "flood, one tenant",
}
# The engine's counters read around each run (``engine/http/metrics.py``).
COUNTERS = {
    "tenant_preemptions": "slotserve_tenant_preemptions_total",
    "tenant_recomputed_tokens": "slotserve_tenant_recomputed_tokens_total",
    "kv_preemptions": "vllm:num_preemptions_total",
    "generation_tokens": "vllm:generation_tokens_total",
}
KEYS = {"fair": ("sk-a", "sk-b"), "one tenant": ("sk-shared-a", "sk-shared-b")}
PROMPT = "Write a short story about a lighthouse keeper and the sea."


def keys_file(weight_a: int, weight_b: int) -> str:
    return (
        f"sk-a tenant=a weight={weight_a}\n"
        f"sk-b tenant=b weight={weight_b}\n"
        "sk-shared-a tenant=shared\n"
        "sk-shared-b tenant=shared\n"
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Procs:
    """The engines (or doubles) and the gateways, stopped together."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.servers: list[ServerProcess] = []

    def start(self, argv: list[str], ready_url: str) -> str:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        wait_until(lambda: http_ok(ready_url), 30, what=ready_url)
        return ready_url.rsplit("/", 1)[0]

    def double(self, slots: int, service_s: float) -> str:
        port = free_port()
        argv = [sys.executable, str(DOUBLE), "--port", str(port), "--slots", str(slots)]
        argv += ["--delay", str(service_s), "--model", "m"]
        return self.start(argv, f"http://127.0.0.1:{port}/health")

    def engine(self, name: str, slots: int, model: str, args: argparse.Namespace) -> str:
        """A real ``slotserve engine`` serving ``model`` as ``name`` (its pool's name)."""
        port = free_port()
        argv = [str(SLOTSERVE), "engine", "--model", model, "--served-model-name", name]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--max-batch-size", str(slots)]
        argv += ["--num-threads", str(args.num_threads), "--max-model-len", "256"]
        argv += ["--log-level", "WARNING", *args.engine_arg]
        log = args.out.with_suffix(f".engine-{name}.log")
        server = ServerProcess(argv, dict(os.environ), log)
        self.servers.append(server)
        url = f"http://127.0.0.1:{port}"
        server.start(f"{url}/ready", timeout=300)
        return url

    def gateway(self, pool_file: Path, keys: Path, redis_url: str | None) -> str:
        port = free_port()
        argv = [str(SLOTSERVE), "gateway", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--config", str(pool_file), "--api-keys-file", str(keys)]
        argv += ["--log-level", "WARNING"]
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
        for server in self.servers:
            server.stop()


@dataclass(frozen=True)
class Load:
    """Who sends what in one run: B's arrival rate (Poisson), A's closed-loop clients."""

    model: str
    rate_b_per_s: float
    clients_a: int = 0


@dataclass
class TenantRun:
    waits_ms: list[float] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)  # queue wait + the answer's time
    num_answered: int = 0
    errors: dict[int, int] = field(default_factory=dict)


def request_body(model: str, rng: random.Random, args: argparse.Namespace) -> dict[str, object]:
    """One completion request: a real engine's length from ``max_tokens``, the double's from
    ``x_delay``; both 0.5x to 1.5x the mean."""
    if args.engine == "double":
        delay = args.service_s * rng.uniform(0.5, 1.5)
        return {"model": model, "prompt": "hello", "max_tokens": 4, "x_delay": delay}
    low, high = max(1, args.new_tokens // 2), max(1, args.new_tokens * 3 // 2)
    max_tokens = rng.randint(low, high)
    return {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0.0,
    }  # fmt: skip


async def measure_capacity(
    gateway: str, model: str, clients: int, args: argparse.Namespace
) -> dict[str, float]:
    """Answers per second of ``clients`` closed-loop clients through a gateway, enough to keep
    its queue from emptying: what the pool delivers to a backlog, slot hand-offs included
    (the first ``warm`` seconds' answers not counted)."""
    rng = random.Random(11)
    warm = 4.0
    started = time.monotonic()
    count_from, stop_at = started + warm, started + warm + args.capacity_seconds
    num_answered, latency_s = 0, []
    headers = {"Authorization": f"Bearer {KEYS['one tenant'][0]}"}

    async def client(s: aiohttp.ClientSession) -> None:
        nonlocal num_answered
        while (sent := time.monotonic()) < stop_at:
            body = request_body(model, rng, args)
            async with s.post(f"{gateway}/v1/completions", json=body, headers=headers) as r:
                await r.read()
                r.raise_for_status()
                wait_s = float(r.headers.get(QUEUE_WAIT_HEADER, "0")) / 1000  # 0: no gateway
            if sent >= count_from:
                num_answered += 1
                latency_s.append(time.monotonic() - sent - wait_s)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(client(s) for _ in range(clients)))
    elapsed = time.monotonic() - count_from
    return {
        "answers_per_s": num_answered / elapsed,
        "service_p50_s": percentile(latency_s, 0.5),
        "service_mean_s": statistics.fmean(latency_s) if latency_s else float("nan"),
    }


async def run_phase(
    gateways: list[str], engine: str, keys: dict[str, str], load: Load, args: argparse.Namespace
) -> dict[str, Any]:
    """B's arrivals and A's clients for ``args.seconds``; the engine's slot use sampled."""
    runs = {"a": TenantRun(), "b": TenantRun()}
    stop_at = time.monotonic() + args.seconds
    busy: list[float] = []
    rng = random.Random(7)
    sent = 0

    async def one(tenant: str, s: aiohttp.ClientSession) -> None:
        nonlocal sent
        url = gateways[sent % len(gateways)]
        sent += 1
        payload = request_body(load.model, rng, args)
        headers = {"Authorization": f"Bearer {keys[tenant]}"}
        run = runs[tenant]
        started = time.monotonic()
        async with s.post(f"{url}/v1/completions", json=payload, headers=headers) as r:
            await r.read()
            if r.status != 200:
                run.errors[r.status] = run.errors.get(r.status, 0) + 1
                await asyncio.sleep(0.05)
                return
            run.num_answered += 1
            run.waits_ms.append(float(r.headers.get(QUEUE_WAIT_HEADER, "nan")))
            run.latencies_ms.append(1000 * (time.monotonic() - started))

    async def flood_client(s: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop_at:
            await one("a", s)

    async def arrivals_b(s: aiohttp.ClientSession) -> None:
        # Poisson arrivals given their count: rate x seconds of them at uniform random times,
        # so B offers exactly its rate (a free Poisson count of ~40 strays by +-15%, and
        # above its share B would be measured queueing behind itself).
        times = arrival_times(load.rate_b_per_s, args.seconds, random.Random(5))
        pending = set()
        for at in times:
            await asyncio.sleep(max(0.0, stop_at - args.seconds + at - time.monotonic()))
            pending.add(asyncio.ensure_future(one("b", s)))
        await asyncio.gather(*pending)

    async def sample_load(s: aiohttp.ClientSession) -> None:
        await asyncio.sleep(1.0)  # the first arrivals are in
        while time.monotonic() < stop_at - 0.5:
            async with s.get(f"{engine}/load") as r:
                load = await r.json()
            # Slots held by a request (prefilling or decoding), as the gateway counts them.
            busy.append(1 - load["slots_free"] / load["slots_total"])
            await asyncio.sleep(0.02)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        before = await engine_counters(s, engine)
        started = time.monotonic()
        floods = [flood_client(s) for _ in range(load.clients_a)]
        await asyncio.gather(sample_load(s), arrivals_b(s), *floods)
        # Rates over the window requests were sent in: the run's end waits for A's backlog.
        elapsed = min(time.monotonic(), stop_at) - started
        after = await engine_counters(s, engine)
    out: dict[str, Any] = {"slots_busy": statistics.fmean(busy) if busy else float("nan")}
    out["engine"] = {name: after[name] - before[name] for name in COUNTERS}
    out["load_average"] = list(os.getloadavg())
    for tenant, run in runs.items():
        if tenant == "a" and not load.clients_a:
            continue
        out[tenant] = {
            "wait_p50_ms": percentile(run.waits_ms, 0.5),
            "wait_p99_ms": percentile(run.waits_ms, 0.99),
            "latency_p50_ms": percentile(run.latencies_ms, 0.5),
            "answered_per_s": run.num_answered / elapsed,
            "errors": run.errors,
        }
    return out


async def engine_counters(s: aiohttp.ClientSession, engine: str) -> dict[str, float]:
    """The engine's counters now (0 for one it does not export, e.g. the double)."""
    async with s.get(f"{engine}/metrics") as r:
        text = await r.text() if r.status == 200 else ""
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for name, metric in COUNTERS.items():
            if line.startswith(metric):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


def arrival_times(rate_per_s: float, seconds: float, rng: random.Random) -> list[float]:
    """round(rate x seconds) arrival times in [0, seconds), uniform and sorted: a Poisson
    process conditioned on its count."""
    return sorted(rng.uniform(0, seconds) for _ in range(round(rate_per_s * seconds)))


def share_slots(args: argparse.Namespace) -> tuple[int, int]:
    """B's and A's shares of the slots (at least one each)."""
    share_b = args.weight_b / (args.weight_a + args.weight_b)
    slots_b = max(1, round(args.slots * share_b))
    return slots_b, max(1, args.slots - slots_b)


def run_backend(
    name: str,
    gateways: list[str],
    engine: str,
    capacity_per_s: float,
    args: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    slots_b, slots_a = share_slots(args)
    rate_b = args.load_b * capacity_per_s * slots_b / args.slots
    fair = dict(zip(("a", "b"), KEYS["fair"], strict=True))
    shared = dict(zip(("a", "b"), KEYS["one tenant"], strict=True))
    every = {
        SHARE: (fair, Load("m", rate_b, slots_a)),
        "B alone, whole pool": (fair, Load("m", rate_b)),
        FLOOD: (fair, Load("m", rate_b, args.flood * slots_a)),
        "flood, one tenant": (shared, Load("m", rate_b, args.flood * slots_a)),
    }
    phases = {PHASES[p]: every[PHASES[p]] for p in args.phases}
    result: dict[str, dict[str, Any]] = {}
    for phase, (keys, load) in phases.items():
        print(f"  {name}: {phase} ({load}) for {args.seconds:.0f} s", flush=True)
        result[phase] = asyncio.run(run_phase(gateways, engine, keys, load, args))
        row = result[phase]
        print(f"    B p50 {row['b']['wait_p50_ms']:.0f} ms, busy {100 * row['slots_busy']:.1f}%, "
              f"engine {row['engine']}")  # fmt: skip
        time.sleep(1.5)  # the last answers settle before the next run
    return result


def print_table(results: dict[str, dict], capacity_per_s: float, gap_ms: float) -> None:
    header = ["B p50 ms", "B p99 ms", "A p50 ms", "A p99 ms", "B req/s", "A req/s", "busy %"]
    header += ["preempt", "recomp"]
    print(f"\n{'backend / run':<42}" + "".join(f"{h:>10}" for h in header))
    for backend, phases in results.items():
        for phase, row in phases.items():
            a, b = row.get("a", {}), row["b"]
            values = [
                b["wait_p50_ms"],
                b["wait_p99_ms"],
                a.get("wait_p50_ms", float("nan")),
                a.get("wait_p99_ms", float("nan")),
                b["answered_per_s"],
                a.get("answered_per_s", 0.0),
                100 * row["slots_busy"],
                row["engine"]["tenant_preemptions"],
                row["engine"]["tenant_recomputed_tokens"],
            ]
            print(f"{backend + ' / ' + phase:<42}" + "".join(f"{v:>10.1f}" for v in values))
    print(
        f"\ncapacity {capacity_per_s:.1f} req/s; a slot frees every {gap_ms:.0f} ms on average "
        "(the least a request that finds every slot taken waits, on any non-preemptive queue)"
    )


def wait_ratios(results: dict[str, dict]) -> dict[str, dict[str, float]]:
    """B's p50 and p99 waits under the flood over its waits on its share (A at its share)."""
    out = {}
    for backend, phases in results.items():
        if SHARE not in phases or FLOOD not in phases:
            continue
        share, flood = phases[SHARE]["b"], phases[FLOOD]["b"]
        out[backend] = {
            q: flood[f"wait_{q}_ms"] / share[f"wait_{q}_ms"]
            if share[f"wait_{q}_ms"] > 0
            else float("inf")
            for q in ("p50", "p99")
        }
    return out


def start_engine(procs: Procs, tmp: Path, args: argparse.Namespace) -> str:
    """The pool's engine (``m``)."""
    if args.engine == "double":
        return procs.double(args.slots, args.service_s)
    if args.model == "tiny":  # a 2-layer random Llama with SmolLM2's tokenizer
        smollm2 = Path(resolve_model("smollm2", show_progress=True))
        model = str(build_tiny_model(tmp / "tiny", tokenizer_dir=smollm2))
    else:
        model = resolve_model(args.model, show_progress=True)
    return procs.engine("m", args.slots, model, args)


def capacities(gateway: str, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """The capacity the arrival rates are drawn from: on a real engine measured through a
    gateway (``m``), twice the slots' clients, after a run straight to the engine (``m direct``:
    it warms the engine too); slots / service_s on the double."""
    if args.engine == "double":
        return {"m": {"answers_per_s": args.slots / args.service_s}}
    if args.capacity_per_s:  # given: runs compared at the same offered load
        return {"m": {"answers_per_s": args.capacity_per_s, "given": True}}
    measured: dict[str, Any] = {}
    clients = 2 * args.slots
    for label, url in (("m direct", engine), ("m", gateway)):
        print(f"  capacity of {label}: {clients} clients for {args.capacity_seconds:.0f} s")
        row = measured[label] = asyncio.run(measure_capacity(url, "m", clients, args))
        print(f"    {row['answers_per_s']:.2f} answers/s, service p50 "
              f"{1000 * row['service_p50_s']:.0f} ms")  # fmt: skip
    return measured


def main() -> int:
    line_buffered_stdout()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine", choices=("real", "double"), default="real", help="slotserve engine or double"
    )
    parser.add_argument("--model", default="smollm2", help="real: name, folder or 'tiny'")
    parser.add_argument("--num-threads", type=int, default=1, help="real: each engine's")
    parser.add_argument("--new-tokens", type=int, default=64, help="real: mean per answer")
    parser.add_argument("--capacity-seconds", type=float, default=30.0, help="real: measured")
    parser.add_argument("--capacity-per-s", type=float, default=0.0,
                        help="real: take this capacity instead of measuring it")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=60.0, help="per run")
    parser.add_argument("--slots", type=int, default=4, help="the pool engine's slots")
    parser.add_argument("--service-s", type=float, default=0.2, help="double: each answer's")
    parser.add_argument("--flood", type=int, default=10, help="A's clients over its share")
    parser.add_argument("--load-b", type=float, default=0.8, help="B's rate / its share's")
    parser.add_argument("--weight-a", type=int, default=1)
    parser.add_argument("--weight-b", type=int, default=1)
    parser.add_argument("--backends", nargs="+", choices=("memory", "redis"),
                        default=["memory", "redis"])  # fmt: skip
    parser.add_argument("--preempt", choices=("on", "off"), default="on",
                        help="the pool's preemptForShare")  # fmt: skip
    parser.add_argument("--phases", nargs="+", choices=tuple(PHASES), default=list(PHASES))
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="real: an extra engine flag (repeat)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "fairness_bench.json")
    args = parser.parse_args()
    procs = Procs()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        try:
            engine = start_engine(procs, Path(tmp), args)
            admission = {"maxQueueSize": 1000, "preemptForShare": args.preempt == "on"}
            pools = [{"model": "m", "endpoints": [engine], "admission": admission}]
            pool_file = Path(tmp) / "pools.yaml"
            pool_file.write_text(yaml.safe_dump({"pools": pools}))
            keys = Path(tmp) / "keys"
            keys.write_text(keys_file(args.weight_a, args.weight_b))
            gateways: dict[str, list[str]] = {}
            if "memory" in args.backends:
                gateways["in-process, 1 replica"] = [procs.gateway(pool_file, keys, None)]
            if "redis" in args.backends:
                on_redis = [procs.gateway(pool_file, keys, redis.url) for _ in range(3)]
                gateways["Redis, 3 replicas"] = on_redis
            time.sleep(2.0)  # every gateway has polled the engines' /load
            measured = capacities(next(iter(gateways.values()))[0], engine, args)
            capacity = measured["m"]["answers_per_s"]
            for backend, urls in gateways.items():
                short = backend.split(",")[0]
                results[backend] = run_backend(short, urls, engine, capacity, args)
        finally:
            procs.stop()
            redis.stop()
    print_table(results, capacity, 1000 / capacity)
    ratios = wait_ratios(results)
    for backend, ratio in ratios.items():
        print(
            f"{backend}: B's wait under the flood / on its share: p50 {ratio['p50']:.2f},"
            f" p99 {ratio['p99']:.2f}"
        )
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs")
    out = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "capacity_per_s": capacity,
        "capacities": measured,
        "slot_gap_ms": 1000 / capacity,
        "wait_ratios": ratios,
        "load_average": load,
        "cpus": os.cpu_count(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
