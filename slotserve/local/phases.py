"""The demo's phases: warm-up, and one workload run against one pool while its engines are
sampled."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from slotserve.local import enginestats
from slotserve.local.report import PhaseResult, summarise
from slotserve.local.stack import PoolPlan, RunningStack
from slotserve.local.workload import RequestSpec, run_workload

# Engine sampling: about once per step (the step clock of the occupancy plot), not more often,
# because every scrape takes a little of the engine's interpreter time.
MIN_SAMPLE_INTERVAL_SECONDS = 0.05
MAX_SAMPLE_INTERVAL_SECONDS = 0.25


async def warm_up(stack: RunningStack) -> float:
    """A short request per engine so first-call costs (lazy init) stay out of the numbers;
    returns the longest time per output token seen (seconds per step at batch 1)."""
    step_seconds = 0.0
    for pool in stack.pools:
        specs = [RequestSpec(f"warmup-{i}", 8, "Hello!", "warmup") for i in range(pool.num_engines)]
        results, _ = await run_workload(stack.gateway_url, pool.model, specs, timeout_seconds=120)
        failed = [r for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"warm-up request to {pool.model} failed: {failed[0].error}")
        step_seconds = max([step_seconds, *(r.tpot or 0.0 for r in results)])
    return step_seconds


def sample_interval(step_seconds: float) -> float:
    """Seconds between engine scrapes: one step, within sensible bounds."""
    return min(MAX_SAMPLE_INTERVAL_SECONDS, max(MIN_SAMPLE_INTERVAL_SECONDS, step_seconds))


async def run_phase(
    console: Console,
    stack: RunningStack,
    pool: PoolPlan,
    name: str,
    specs: list[RequestSpec],
    stagger_seconds: float = 0.0,
    sample_interval_seconds: float = MIN_SAMPLE_INTERVAL_SECONDS,
) -> PhaseResult:
    """Run one workload against one pool while sampling its engines; return its table row."""
    engine_urls = pool.endpoints(stack.host)
    before = await enginestats.scrape_all(engine_urls)
    sampler = enginestats.OccupancySampler(engine_urls, interval_seconds=sample_interval_seconds)
    total_tokens = sum(spec.max_tokens for spec in specs)
    columns = (
        TextColumn(f"{name:<10} [dim]{pool.model:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(name, total=total_tokens)
        t0 = time.monotonic()
        await sampler.start(before, t0)
        try:
            results, wall = await run_workload(
                stack.gateway_url,
                pool.model,
                specs,
                stagger_seconds=stagger_seconds,
                on_token=lambda _: progress.advance(task),
                t0=t0,
            )
        finally:
            samples = await sampler.stop()
        done = sum(r.num_tokens for r in results if r.ok)
        progress.update(task, total=done, completed=done)
    after = await enginestats.scrape_all(engine_urls)
    return summarise(
        name,
        pool.engine.batching.policy,
        pool.model,
        results,
        wall,
        slot_utilisation=enginestats.phase_utilisation(before, after),
        num_steps=enginestats.phase_steps(before, after),
        num_slots=pool.engine.batching.max_batch_size * pool.num_engines,
        occupancy=samples,
    )
