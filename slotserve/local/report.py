"""The demo's outputs: one table (terminal + text file), results.json and two PNG plots.

Every PNG carries the run id and the numbers it plots in its text chunks (``slotserve-run-id``,
``slotserve-data``), so a plot can always be traced back to the run and the table it belongs to.
"""

from __future__ import annotations

import io
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from slotserve.local.enginestats import OccupancySample
from slotserve.local.workload import RequestResult

COLUMNS = (
    "phase",
    "policy",
    "ok/sent",
    "wall s",
    "useful tok/s",
    "slot util",
    "TTFT p50 s",
    "TTFT p99 s",
    "TPOT p50 ms",
    "TPOT p99 ms",
    "429s",
)


@dataclass
class PhaseResult:
    """One row of the table, with the raw material behind it."""

    name: str
    policy: str
    model: str
    num_sent: int
    num_ok: int
    num_rejected: int
    num_failed: int
    wall_seconds: float
    useful_tokens: int
    tokens_per_second: float
    slot_utilisation: float | None
    num_steps: int
    num_slots: int
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    retry_after: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    occupancy: list[OccupancySample] = field(default_factory=list)
    requests: list[RequestResult] = field(default_factory=list)

    def row(self) -> list[str]:
        """The table row, exactly as printed."""
        return [
            self.name,
            self.policy,
            f"{self.num_ok}/{self.num_sent}",
            f"{self.wall_seconds:.1f}",
            f"{self.tokens_per_second:.1f}",
            _percent(self.slot_utilisation),
            _fmt(self.ttft_p50, 1.0, 2),
            _fmt(self.ttft_p99, 1.0, 2),
            _fmt(self.tpot_p50, 1000.0, 1),
            _fmt(self.tpot_p99, 1000.0, 1),
            str(self.num_rejected),
        ]

    def to_json(self) -> dict[str, object]:
        data = {
            key: value
            for key, value in asdict(self).items()
            if key not in {"occupancy", "requests"}
        }
        data["row"] = self.row()
        data["occupancy"] = [asdict(sample) for sample in self.occupancy]
        data["requests"] = [request.to_json() for request in self.requests]
        return data


def _fmt(value: float | None, factor: float, digits: int) -> str:
    return "-" if value is None else f"{value * factor:.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(
    name: str,
    policy: str,
    model: str,
    results: list[RequestResult],
    wall_seconds: float,
    *,
    slot_utilisation: float | None,
    num_steps: int,
    num_slots: int,
    occupancy: list[OccupancySample],
) -> PhaseResult:
    """Turn one phase's client results and engine numbers into a table row."""
    ok = [r for r in results if r.ok]
    rejected = [r for r in results if r.status == 429]
    failed = [r for r in results if not r.ok and r.status != 429]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    useful = sum(r.num_tokens for r in ok)
    return PhaseResult(
        name=name,
        policy=policy,
        model=model,
        num_sent=len(results),
        num_ok=len(ok),
        num_rejected=len(rejected),
        num_failed=len(failed),
        wall_seconds=wall_seconds,
        useful_tokens=useful,
        tokens_per_second=useful / wall_seconds if wall_seconds > 0 else 0.0,
        slot_utilisation=slot_utilisation,
        num_steps=num_steps,
        num_slots=num_slots,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        retry_after=[r.retry_after for r in rejected if r.retry_after is not None],
        errors=[f"{r.request_id}: {r.status} {r.error}" for r in failed],
        occupancy=occupancy,
        requests=results,
    )


def build_table(phases: list[PhaseResult], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for index, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if index < 2 else "right", no_wrap=True)
    for phase in phases:
        table.add_row(*phase.row())
    return table


def table_text(phases: list[PhaseResult], title: str) -> str:
    """The table as plain text (what results/table.txt holds)."""
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    console.print(build_table(phases, title))
    return console.export_text()


def write_results(
    results_dir: Path,
    run_id: str,
    phases: list[PhaseResult],
    meta: dict[str, object],
    title: str,
) -> dict[str, Path]:
    """Write results.json, table.txt and the plots; return their paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": results_dir / "results.json",
        "table": results_dir / "table.txt",
        "occupancy": results_dir / "occupancy.png",
        "latency": results_dir / "latency_throughput.png",
    }
    document = {
        "run_id": run_id,
        "columns": list(COLUMNS),
        "meta": meta,
        "phases": [phase.to_json() for phase in phases],
    }
    paths["json"].write_text(json.dumps(document, indent=2))
    paths["table"].write_text(table_text(phases, title))
    plot_occupancy(phases, paths["occupancy"], run_id)
    plot_latency_throughput(phases, paths["latency"], run_id)
    return paths


def _save(figure: Figure, path: Path, run_id: str, data: object) -> None:
    metadata = {"slotserve-run-id": run_id, "slotserve-data": json.dumps(data)}
    figure.savefig(path, dpi=110, metadata=metadata)
    plt.close(figure)


def plot_occupancy(phases: list[PhaseResult], path: Path, run_id: str) -> None:
    """Requests holding a slot at each engine step, one panel per policy, side by side.

    The line is rebuilt from each request's first-token time (placed on the engine's step
    counter) and token count: a request holds its slot for exactly as many steps as it has
    tokens. The dots are the engine's own ``num_requests_running`` samples.
    """
    shown = [phase for phase in phases if phase.name != "burst"]
    num_panels = max(1, len(shown))
    figure, axes = plt.subplots(
        1, num_panels, figsize=(5 * num_panels, 3.6), sharey=True, squeeze=False
    )
    data = {}
    for axis, phase in zip(axes[0], shown, strict=False):
        counts = occupancy_from_requests(phase.requests, phase.occupancy)
        steps = list(range(1, len(counts) + 1))
        axis.fill_between(steps, counts, step="post", alpha=0.35)
        axis.step(steps, counts, where="post", linewidth=1.2, label="requests in a slot")
        sampled = [(s.step, s.running) for s in phase.occupancy if s.running or s.step]
        if sampled:
            axis.plot(*zip(*sampled, strict=True), ".", markersize=3, alpha=0.6,
                      label="engine samples")  # fmt: skip
        axis.axhline(phase.num_slots, color="grey", linestyle=":", linewidth=1)
        util = _percent(phase.slot_utilisation)
        axis.set_title(f"{phase.policy}: {phase.num_steps} steps, utilisation {util}")
        axis.set_xlabel("engine step")
        axis.set_ylim(0, phase.num_slots + 0.5)
        axis.grid(alpha=0.3)
        data[phase.name] = {"occupancy_per_step": counts, "row": phase.row()}
    axes[0][0].set_ylabel("requests holding a slot")
    axes[0][0].legend(loc="lower left", fontsize=8)
    figure.suptitle("Slot occupancy over engine steps (same workload, same slots)")
    figure.tight_layout()
    _save(figure, path, run_id, data)


def step_at(samples: list[OccupancySample], t: float) -> float:
    """The pool's step counter at time ``t``, interpolated between samples (busiest engine)."""
    points = sorted((sample.t, sample.step) for sample in samples)
    if not points:
        return 0.0
    if t <= points[0][0]:
        return points[0][1]
    for (t0, s0), (t1, s1) in itertools.pairwise(points):
        if t0 <= t <= t1:
            return s0 if t1 == t0 else s0 + (s1 - s0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def occupancy_from_requests(
    requests: list[RequestResult], samples: list[OccupancySample]
) -> list[int]:
    """Requests holding a slot at steps 1..N: each from the step of its first token, one step
    per token (a decode step gives every running sequence exactly one token)."""
    busiest = max((s.engine for s in samples), key=lambda e: _last_step(samples, e), default="")
    clock = [s for s in samples if s.engine == busiest]
    intervals = []
    for request in requests:
        if not request.ok or request.first_token_at is None or request.num_tokens < 1:
            continue
        start = max(1, round(step_at(clock, request.first_token_at)))
        intervals.append((start, start + request.num_tokens - 1))
    num_steps = max((end for _, end in intervals), default=0)
    counts = [0] * num_steps
    for start, end in intervals:
        for step in range(start, end + 1):
            counts[step - 1] += 1
    return counts


def _last_step(samples: list[OccupancySample], engine: str) -> float:
    return max((s.step for s in samples if s.engine == engine), default=0.0)


def plot_latency_throughput(phases: list[PhaseResult], path: Path, run_id: str) -> None:
    """Useful tokens/s against TTFT and TPOT (p50 marker, p99 whisker), one point per phase."""
    figure, (ttft_axis, tpot_axis) = plt.subplots(1, 2, figsize=(10, 4))
    data = {}
    for phase in phases:
        x = phase.tokens_per_second
        data[phase.name] = {"tokens_per_second": x, "row": phase.row()}
        for axis, p50, p99, factor in (
            (ttft_axis, phase.ttft_p50, phase.ttft_p99, 1.0),
            (tpot_axis, phase.tpot_p50, phase.tpot_p99, 1000.0),
        ):
            if p50 is None or p99 is None:
                continue
            low, high = p50 * factor, p99 * factor
            axis.errorbar([x], [low], yerr=[[0.0], [max(0.0, high - low)]], fmt="o", capsize=4)
            axis.annotate(phase.name, (x, low), textcoords="offset points", xytext=(6, 4))
    ttft_axis.set_ylabel("time to first token (s): p50, whisker to p99")
    tpot_axis.set_ylabel("time per output token (ms): p50, whisker to p99")
    for axis in (ttft_axis, tpot_axis):
        axis.set_xlabel("useful tokens / s")
        axis.grid(alpha=0.3)
    figure.suptitle("Latency against throughput, per phase")
    figure.tight_layout()
    _save(figure, path, run_id, data)
