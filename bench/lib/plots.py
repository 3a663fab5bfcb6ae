"""PNG plots for bench/engine_bench.py (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def occupancy_matrix(records: list, num_slots: int) -> np.ndarray:
    """slots x steps; each cell the index of the request in the slot (NaN when idle)."""
    ids: dict[str, int] = {}
    grid = np.full((num_slots, len(records)), np.nan)
    for column, record in enumerate(records):
        for slot, request_id in record.slots.items():
            grid[slot, column] = ids.setdefault(request_id, len(ids))
    return grid


def plot_occupancy(static: list, continuous: list, num_slots: int, path: Path) -> None:
    width = max(len(static), len(continuous))
    fig, axes = plt.subplots(2, 1, figsize=(12, 4.5), sharex=True)
    for ax, records, name in ((axes[0], static, "static"), (axes[1], continuous, "continuous")):
        grid = occupancy_matrix(records, num_slots)
        used = np.count_nonzero(~np.isnan(grid))
        ax.imshow(
            np.ma.masked_invalid(grid % 20),
            aspect="auto",
            interpolation="nearest",
            cmap="tab20",
            extent=(0.5, grid.shape[1] + 0.5, num_slots - 0.5, -0.5),
        )
        ax.set_facecolor("white")
        ax.set_ylabel("slot")
        ax.set_yticks(range(num_slots))
        ax.set_title(
            f"{name}: {grid.shape[1]} steps, {used} of {grid.size} slot-steps busy "
            f"({used / max(1, grid.size):.1%}); colour = request, white = idle"
        )
        ax.set_xlim(0.5, width + 0.5)
    axes[1].set_xlabel("engine step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_poisson(rows: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy, marker in (("continuous", "o-"), ("static", "s--")):
        selected = [row for row in rows if row["policy"] == policy]
        if not selected:
            continue
        throughput = [row["output_token_throughput"] for row in selected]
        for ax, key in ((axes[0], "tpot"), (axes[1], "ttft")):
            for quantile, alpha in (("p50", 1.0), ("p99", 0.5)):
                values = [row[f"{key}_{quantile}_ms"] for row in selected]
                ax.plot(throughput, values, marker, alpha=alpha, label=f"{policy} {quantile}")
            for row, x in zip(selected, throughput, strict=True):
                ax.annotate(f"{row['rate_req_s']:g}/s", (x, row[f"{key}_p50_ms"]), fontsize=7)
    axes[0].set_ylabel("time per output token (ms)")
    axes[1].set_ylabel("time to first token (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Poisson arrivals (labels: offered request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_decode(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [row["ours_tok_s"] for row in rows], 0.4, label="slotserve engine")
    ax.bar(x + 0.2, [row["hf_generate_tok_s"] for row in rows], 0.4, label="HF generate()")
    ax.set_xticks(x, [f"batch {row['batch']}" for row in rows])
    ax.set_ylabel("decode tokens/s (aggregate)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
