"""``slotserve demo`` (what ``make demo`` runs): the batching story, measured on a real model.

One engine per policy (static, dynamic, continuous) sits behind one gateway, each as its own pool
(``smollm2-static``, ...). The same workload (the seed's 20/50/100/500-token requests plus late
arrivals) runs through the gateway against each pool in turn, then a burst above capacity shows
admission: the first requests take the slots, the next ones queue, the rest get 429 with
Retry-After. Prints one table and writes results.json, table.txt and two plots.

    slotserve demo
    slotserve demo --model /path/to/tiny --max-tokens-scale 0.1 --engines 1   # quick check
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from slotserve.contracts.pool_spec import (
    BATCHING_POLICIES,
    AdmissionSpec,
    BatchingPolicy,
    BatchingSpec,
)
from slotserve.contracts.weights import DTYPES, QUANTIZATIONS
from slotserve.local.phases import run_phase, sample_interval, warm_up
from slotserve.local.processes import ChildExitedError, Supervisor, interrupt_on_signals
from slotserve.local.report import PhaseResult, build_table, write_results
from slotserve.local.stack import (
    DEMO_MODEL,
    EngineOptions,
    PoolPlan,
    RunningStack,
    assign_ports,
    default_num_threads,
    describe_redis,
    free_port,
    plan_redis,
    resolve_model_once,
    start_stack,
)
from slotserve.local.workload import (
    burst_workload,
    seed_workload,
)
from slotserve.models.resolve import default_served_name

POLICIES = BATCHING_POLICIES
# How long a static/dynamic engine gathers a batch that is not full (the engine forms batches;
# the gateway passes requests on as slots free): requests sent together arrive well within it.
BATCH_FORM_DELAY_MICROSECONDS = 100_000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotserve demo",
        description="Static vs dynamic vs continuous batching and gateway admission, measured.",
    )
    parser.add_argument("--model", default=DEMO_MODEL, help="name, local HF folder or hub id")
    parser.add_argument("--engines", type=int, default=1, help="engines per policy pool")
    parser.add_argument("--max-batch-size", type=int, default=4, help="slots per engine")
    parser.add_argument(
        "--max-tokens-scale",
        type=float,
        default=1.0,
        help="multiply every max_tokens and trigger point (0.1 for a quick run)",
    )
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated policies to compare"
    )
    parser.add_argument("--max-queue-size", type=int, default=10, help="gateway queue limit")
    parser.add_argument(
        "--burst-requests", type=int, help="burst size (default: slots + queue + 10)"
    )
    parser.add_argument("--no-burst", action="store_true", help="skip the admission burst")
    parser.add_argument("--results-dir", type=Path, help="default: results/demo-<UTC time>")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, help="gateway port (default: a free one)")
    parser.add_argument("--num-threads", type=int, help="torch threads per engine")
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS, help="weight-only int8/int4 (CPU engines)"
    )
    parser.add_argument("--redis-url", help="use this Redis (default: start redis-server if found)")
    parser.add_argument("--no-redis", action="store_true", help="in-process admission")
    parser.add_argument("--ready-timeout-seconds", type=float, default=300)
    return parser


def plan_pools(
    args: argparse.Namespace, model_source: str, policies: list[BatchingPolicy]
) -> list[PoolPlan]:
    """One pool per policy: same model, same slots, a distinct OpenAI model name."""
    base = default_served_name(args.model)
    longest = max(1, round(500 * args.max_tokens_scale))
    max_model_len = 256 * (1 + (longest + 200) // 256)  # the prompt plus the longest answer
    pools = []
    for policy in policies:
        delay = 100 if policy == "continuous" else BATCH_FORM_DELAY_MICROSECONDS
        engine = EngineOptions(
            model=model_source,
            served_model_name=f"{base}-{policy}",
            batching=BatchingSpec(
                policy=policy,
                max_batch_size=args.max_batch_size,
                max_queue_delay_microseconds=delay,
            ),
            max_model_len=max_model_len,
            kv_cache_tokens=args.max_batch_size * max_model_len,
            # Phases run one after the other, so the busy pool's engines get every core.
            num_threads=args.num_threads or default_num_threads(args.engines),
            dtype=args.dtype,
            quantization=args.quantization,
        )
        # A generous queue timeout: under static batching late arrivals wait for a whole batch.
        admission = AdmissionSpec(max_queue_size=args.max_queue_size, queue_timeout_seconds=900)
        pools.append(PoolPlan(engine=engine, num_engines=args.engines, admission=admission))
    return pools


async def run_demo(
    console: Console, stack: RunningStack, args: argparse.Namespace, phases: list[PhaseResult]
) -> None:
    """Run every phase, appending each result to ``phases`` as soon as it is complete."""
    console.print("Warming up every engine ...")
    step_seconds = await warm_up(stack)
    interval = sample_interval(step_seconds)
    workload = seed_workload(args.max_tokens_scale)
    console.print(
        f"\n[bold]1. The same workload under each policy[/]: {len(workload)} requests "
        f"(max_tokens {', '.join(str(s.max_tokens) for s in workload if s.group == 'seed')}, "
        f"then {sum(s.group == 'late' for s in workload)} late arrivals), ignore_eos"
    )
    for pool in stack.pools:
        policy = pool.engine.batching.policy
        phases.append(
            await run_phase(
                console, stack, pool, policy, workload, sample_interval_seconds=interval
            )
        )
    if not args.no_burst:
        continuous = (p for p in stack.pools if p.engine.batching.policy == "continuous")
        pool = next(continuous, stack.pools[-1])
        num_slots = pool.engine.batching.max_batch_size * pool.num_engines
        num_burst = args.burst_requests or num_slots + pool.admission.max_queue_size + 10
        console.print(
            f"\n[bold]2. A burst above capacity[/]: {num_burst} requests at once against "
            f"{num_slots} slots and a gateway queue of {pool.admission.max_queue_size}"
        )
        burst = burst_workload(num_burst, args.max_tokens_scale)
        phases.append(
            await run_phase(
                console,
                stack,
                pool,
                "burst",
                burst,
                stagger_seconds=0.002,
                sample_interval_seconds=interval,
            )
        )


def print_story(console: Console, phases: list[PhaseResult]) -> None:
    """Two or three sentences that say what the table shows."""
    by_name = {phase.name: phase for phase in phases}
    seed_phases = [by_name[name] for name in POLICIES if name in by_name]
    if len(seed_phases) > 1:
        steps = " / ".join(f"{p.num_steps} ({p.name})" for p in seed_phases)
        console.print(f"Engine steps for the same tokens: {steps}.")
    static, continuous = by_name.get("static"), by_name.get("continuous")
    if static and continuous and static.wall_seconds > 0 and static.tokens_per_second > 0:
        late_static = _late_ttft(static)
        late_continuous = _late_ttft(continuous)
        speedup = continuous.tokens_per_second / static.tokens_per_second
        console.print(
            f"Continuous batching did the same work in {continuous.wall_seconds:.1f} s instead of "
            f"{static.wall_seconds:.1f} s ({speedup:.2f}x "
            f"the useful tokens/s); late arrivals waited {late_continuous:.2f} s for their first "
            f"token (median) instead of {late_static:.2f} s."
        )
    burst = by_name.get("burst")
    if burst:
        retry = sorted(set(burst.retry_after))
        console.print(
            f"Burst: {burst.num_ok} of {burst.num_sent} answered ({burst.num_slots} at once, the "
            f"rest after queueing, TTFT p99 {burst.ttft_p99 or 0:.2f} s); {burst.num_rejected} "
            f"refused at once with 429 (Retry-After: {', '.join(retry) or '-'} s)."
        )


def _late_ttft(phase: PhaseResult) -> float:
    values = sorted(r.ttft for r in phase.requests if r.group == "late" and r.ttft is not None)
    return values[len(values) // 2] if values else float("nan")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    requested = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(requested) - set(POLICIES))
    # The requested names as policies, in the order given (unknown names are refused below).
    policies = [policy for name in requested for policy in POLICIES if policy == name]
    if unknown or not policies or args.engines < 1 or args.max_tokens_scale <= 0:
        raise SystemExit(
            "slotserve demo: --policies takes static,dynamic,continuous; --engines >= 1; "
            "--max-tokens-scale > 0"
        )
    console = Console(highlight=False, width=None if Console().is_terminal else 160)
    started = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    results_dir = (args.results_dir or Path("results") / f"demo-{stamp}").resolve()
    run_id = f"{stamp}-{uuid.uuid4().hex[:8]}"
    phases: list[PhaseResult] = []
    redis_mode = "-"
    interrupted = False
    with interrupt_on_signals():
        try:
            with Supervisor(results_dir / "logs", console=console) as supervisor:
                console.print(f"Resolving model [bold]{args.model}[/] ...")
                pools = plan_pools(args, resolve_model_once(args.model), policies)
                assign_ports(pools)
                redis = plan_redis(args.redis_url, use_redis=not args.no_redis)
                redis_mode = redis.mode
                console.print(
                    f"Starting {len(pools) * args.engines} engine(s) ({', '.join(policies)}), "
                    f"a gateway and {describe_redis(redis)} ..."
                )
                stack = start_stack(
                    supervisor,
                    pools,
                    host=args.host,
                    gateway_port=args.port or free_port(),
                    redis=redis,
                    run_dir=results_dir,
                    ready_timeout_seconds=args.ready_timeout_seconds,
                )
                asyncio.run(run_demo(console, stack, args, phases))
                supervisor.check_alive()
        except KeyboardInterrupt:
            console.print("\nInterrupted: every child process has been stopped.")
            if not phases:
                return 130
            interrupted = True  # still report the phases that completed
        except (ChildExitedError, TimeoutError, RuntimeError) as exc:
            console.print("[red]slotserve demo failed:[/]")
            console.print(str(exc), markup=False)
            return 1
    title = (
        f"slotserve demo: {default_served_name(args.model)}, {args.engines} engine(s) per policy, "
        f"{args.max_batch_size} slots each, max_tokens x{args.max_tokens_scale:g}"
        + (" (interrupted: completed phases only)" if interrupted else "")
    )
    meta = {
        "model": args.model,
        "engines_per_policy": args.engines,
        "max_batch_size": args.max_batch_size,
        "max_tokens_scale": args.max_tokens_scale,
        "max_queue_size": args.max_queue_size,
        "admission_backend": redis_mode,
        "interrupted": interrupted,
        "num_cpus": os.cpu_count(),
        "started_utc": stamp,
        "duration_seconds": round(time.monotonic() - started, 1),
    }
    paths = write_results(results_dir, run_id, phases, meta, title)
    console.print()
    console.print(build_table(phases, title))
    print_story(console, phases)
    console.print(f"\nResults (run {run_id}) in [bold]{results_dir}[/]:")
    for path in paths.values():
        console.print(f"  {path}")
    if interrupted:
        return 130
    failed = [error for phase in phases for error in phase.errors]
    if failed:
        console.print(f"[red]{len(failed)} request(s) failed:[/]")
        console.print("\n".join(failed[:5]), markup=False)
        return 1
    return 0
