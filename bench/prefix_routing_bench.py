"""Prefix-aware routing against today's load routing (issue 29), side by side in one run.

    .venv/bin/python -m bench.prefix_routing_bench --out results/prefix_routing
    .venv/bin/python -m bench.prefix_routing_bench --quick --out results/prefix_routing_quick

A real pool on this machine: one redis-server, ``--engines`` (3) ``slotserve engine`` processes
serving SmolLM2 (``--slots`` 4 each, the prefix cache on as by default, ``--num-threads`` 1 each:
three engines share two cores) and ``--gateways`` (2) gateway replicas on that Redis, one pool
file listing the engines. Clients send streamed chat completions, alternating between the
gateways. Each routing is a pool file: ``load`` sets ``routing: {prefixAware: false,
sessionHeader: "", sessionFromUser: false}``, ``prefix`` sets ``routing: {prefixAware: true}``
(a request whose engine is full waits for it a while, docs/gateway.md), ``nowait`` the same with
``cacheWaitMilliseconds: 0`` (routed among the engines with room at once, as before that wait),
``today`` the ``load`` block on engines with one KV row per slot whatever ``--prefix-cache-rows``
says (the pool as a user had it before issue 29: no prefix routing, no spare rows); where the
installed gateway has no ``routing`` field (``PoolConfig``), only ``load`` and ``today`` run and
the output says so. Every (workload, routing) cell starts cold: engines and gateways restarted,
Redis flushed. The routings alternate their order across ``--repeats``.

Workloads (``--workloads``; prompts are windows of bench/data/quality_text.txt, seeded):

- ``chat``: ``--conversations`` (12) concurrent conversations of ``--turns`` (4) turns, each turn
  a distinct ``--message-tokens`` (300) token user message on top of the history (the earlier
  messages and the assistant's actual answers), ``--chat-new-tokens`` (32) new tokens, greedy,
  a think time uniform in ``--think`` (0.3-2.5 s) before each later turn (without it a closed
  loop hands a conversation its own freed slot by accident);
- ``chat-wide``: the same with ``--wide-conversations`` (36: 3x the rows of the 3 engines);
- ``system``: ``--system-prompts`` (8) system prompts of ``--system-tokens`` (1,000) tokens,
  ``--system-requests`` (48) requests from ``--system-clients`` (8) clients, each a system prompt
  and a short distinct question, ``--system-new-tokens`` (16) new tokens.

``--prefix-cache-rows N`` gives each engine N KV rows (at least ``--slots``: the spare ones keep
finished prefixes, docs/engine.md); ``--engine-arg`` passes any other engine flag through.

Per cell: the engines' own prefix-cache counters (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``, read from each engine's /metrics before and after) as a share of
prompt tokens, beside the ideal share (``IdealCache``: the tokens each prompt shares with an
earlier prompt and its answer) and the ratio of the two; TTFT p50/p90 of first and of later
turns; completed requests per second; errors; each engine's requests (busiest / mean); the most
requests each engine ran at once (its /load polled at 20 Hz) against its slots; and per request
the prompt tokens its engine served from a row (its answer's ``usage.prompt_tokens_details.
cached_tokens``) beside its ideal reuse, the gateway's queue wait and when it was sent: the hit
share by turn, and how many requests got under half their ideal (a miss: which turn, when).
Prints a table per workload (routings side by side, prefix / load) and writes ``results.json``
under ``--out`` (each cell's ``requests`` list holds the per-request figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.lib.chat_workloads import (
    Conversation,
    conversations,
    system_requests,
)
from bench.lib.machine import cpu_info, load_average, read_cpuinfo
from bench.lib.output import line_buffered_stdout
from bench.lib.pool_stack import EngineSpec, LoadSampler, PoolStack, scrape
from bench.lib.routing_cells import CellRun, summarize
from bench.lib.services import RedisServer
from slotserve.gateway.pools.config import PoolConfig
from slotserve.models.resolve import resolve_model

ROUTINGS: dict[str, dict[str, Any]] = {
    # The pool as it was before issue 29: load routing on engines with one KV row per slot,
    # whatever --prefix-cache-rows gives the other routings' engines.
    "today": {"prefixAware": False, "sessionHeader": "", "sessionFromUser": False},
    "load": {"prefixAware": False, "sessionHeader": "", "sessionFromUser": False},
    # Prefix routing without waiting for a full engine that holds the prefix (before the wait).
    "nowait": {"prefixAware": True, "cacheWaitMilliseconds": 0},
    "prefix": {"prefixAware": True},
}
WORKLOADS = ("chat", "chat-wide", "system")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:request_success")
MODEL_NAME = "bench"
SESSION_HEADER = "x-session-id"
ROOT = Path(__file__).resolve().parents[1]


def code_state() -> dict[str, Any]:
    """The checkout's commit and the files changed since (the code under test may be
    uncommitted work)."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return done.stdout.rstrip("\n")  # a status line starts with a space: keep it

    changed = [
        line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
    ]
    return {"commit": git("rev-parse", "--short", "HEAD"), "changed_files": changed}


def routing_known() -> bool:
    """Whether the installed gateway's pool file takes a ``routing`` block (issue 29)."""
    return "routing" in PoolConfig.model_fields


async def run_chat(
    run: CellRun, gateways: list[str], convs: list[Conversation], args: argparse.Namespace
) -> None:
    """Every conversation at once, each turn after the previous answer and a think time."""

    async def one(conv: Conversation) -> None:
        history: list[dict[str, str]] = []
        for turn, text in enumerate(conv.messages):
            if turn:
                await asyncio.sleep(conv.think_s[turn - 1])
            history.append({"role": "user", "content": text})
            headers = {SESSION_HEADER: conv.id} if args.session_header else None
            answer = await run.send(
                gateways,
                list(history),
                args.chat_new_tokens,
                turn > 0,
                headers,
                args,
                conv.id,
                turn,
            )
            if answer is None:
                return  # the conversation cannot go on without its answer
            history.append({"role": "assistant", "content": answer})

    await asyncio.gather(*(one(conv) for conv in convs))


async def run_system(
    run: CellRun,
    gateways: list[str],
    requests: list[list[dict[str, str]]],
    args: argparse.Namespace,
) -> None:
    """``--system-clients`` closed-loop clients sharing the requests in order."""
    queue = list(reversed(requests))

    async def client() -> None:
        while queue:
            await run.send(gateways, queue.pop(), args.system_new_tokens, False, None, args)

    await asyncio.gather(*(client() for _ in range(args.system_clients)))


def workload_inputs(name: str, tokenizer: Any, args: argparse.Namespace) -> Any:
    """The workload's conversations or requests (its own seed, so no two workloads share
    text windows that a previous cell's rows could hold)."""
    think = (args.think[0], args.think[1])
    if name == "chat":
        return conversations(
            tokenizer, args.conversations, args.turns, args.message_tokens, think, seed=1
        )
    if name == "chat-wide":
        return conversations(
            tokenizer, args.wide_conversations, args.turns, args.message_tokens, think, seed=2
        )
    return system_requests(
        tokenizer, args.system_prompts, args.system_tokens, args.system_requests, seed=3
    )


async def measure(
    stack: PoolStack, workload: str, inputs: Any, args: argparse.Namespace
) -> CellRun:
    """One workload on a started pool, with the engines' counters around it and their /load
    sampled throughout."""
    run = CellRun(model=MODEL_NAME, timeout_s=args.request_timeout)
    await run.warm(stack.engines)
    before = await scrape(stack.engines, COUNTERS)
    sampler, stop = LoadSampler(stack.engines), asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    started = time.perf_counter()
    async with run.session():
        if workload == "system":
            body = run_system(run, stack.gateways, inputs, args)
        else:
            body = run_chat(run, stack.gateways, inputs, args)
        await asyncio.wait_for(body, args.cell_timeout)
    run.wall_s = time.perf_counter() - started
    stop.set()
    await sampling
    run.sampler = sampler
    after = await scrape(stack.engines, COUNTERS)
    run.counters = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
    return run


def median_of(cells: list[dict[str, Any]], key: str) -> float:
    values = [c[key] for c in cells if c.get(key) is not None]
    return statistics.median(values) if values else float("nan")


ROWS = (
    ("hit share (engines' counters)", "hit_share", "{:.1%}"),
    ("ideal share (history / prompt)", "ideal_share", "{:.1%}"),
    ("hit share / ideal", "hit_of_ideal", "{:.2f}"),
    ("requests served < half their ideal reuse", "missed_turns", "{:.0f}"),
    ("TTFT p50 first turns, s", "ttft_first_p50_s", "{:.2f}"),
    ("TTFT p90 first turns, s", "ttft_first_p90_s", "{:.2f}"),
    ("TTFT p50 later turns, s", "ttft_later_p50_s", "{:.2f}"),
    ("TTFT p90 later turns, s", "ttft_later_p90_s", "{:.2f}"),
    ("TTFT p50 all, s", "ttft_all_p50_s", "{:.2f}"),
    ("completed req/s", "requests_per_s", "{:.3f}"),
    ("completed / sent", "completed_of_sent", "{:.0f}"),
    ("errors", "num_errors", "{:.0f}"),
    ("busiest engine's requests / mean", "busiest_over_mean", "{:.2f}"),
    ("most running on an engine - its slots", "max_running_over_slots", "{:+.0f}"),
    ("wall, s", "wall_s", "{:.1f}"),
)


def print_table(workload: str, cells: dict[str, list[dict[str, Any]]]) -> None:
    routings = list(cells)
    repeats = max(len(c) for c in cells.values())
    print(f"\n{workload} (median of {repeats} repeat(s))")
    header = f"{'':<40}" + "".join(f"{r:>10}" for r in routings)
    ratios = [f"{routings[-1]}/{r}" for r in routings[:-1]]  # the last against each other
    print(header + "".join(f"{r:>15}" for r in ratios))
    for label, key, fmt in ROWS:
        values = [median_of(cells[r], key) for r in routings]
        text = "".join(f"{fmt.format(v):>10}" for v in values)
        if key not in ("num_errors", "max_running_over_slots", "missed_turns"):
            text += "".join(f"{values[-1] / v:>15.2f}" if v else f"{'':>15}" for v in values[:-1])
        print(f"{label:<40}{text}")
    for name, value, met in target_checks(workload, cells):
        print(f"target: {name:<52}{value:>8.3f}  {'met' if met else 'MISSED'}")


def target_checks(
    workload: str, cells: dict[str, list[dict[str, Any]]]
) -> list[tuple[str, float, bool]]:
    """Issue 29's targets for this workload, from the medians: (what, value, met)."""
    bases = [b for b in ("today", "load") if cells.get(b)]
    if not cells.get("prefix") or not bases:
        return []

    def med(routing: str, key: str) -> float:
        return median_of(cells[routing], key)

    over = max(c["max_running_over_slots"] or 0 for runs in cells.values() for c in runs)
    checks = [("most running on an engine - its slots, any run <= 0", float(over), over <= 0)]
    if workload == "system":
        ratios = [(b, med(b, "ttft_all_p50_s") / med("prefix", "ttft_all_p50_s")) for b in bases]
        return [(f"TTFT p50, {b} / prefix >= 2", r, r >= 2) for b, r in ratios] + checks
    hit = med("prefix", "hit_of_ideal")
    busiest = med("prefix", "busiest_over_mean")
    out = [("prefix: hit share / ideal >= 0.9", hit, hit >= 0.9)]
    for base in bases:
        later = med(base, "ttft_later_p50_s") / med("prefix", "ttft_later_p50_s")
        rate = med("prefix", "requests_per_s") / med(base, "requests_per_s")
        out += [
            (f"later turns' TTFT p50, {base} / prefix >= 2", later, later >= 2),
            (f"completed req/s, prefix / {base} >= 1.2", rate, rate >= 1.2),
        ]
    return [
        *out,
        ("prefix: busiest engine's requests / mean <= 1.5", busiest, busiest <= 1.5),
        *checks,
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", type=Path, default=Path("results/prefix_routing"), help="folder for results")
    add("--routings", default="load,prefix", help="comma-separated: " + ", ".join(ROUTINGS))
    add("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    add("--repeats", type=int, default=1, help="each cell's runs (routings' order alternates)")
    add("--quick", action="store_true", help="smoke run: 2 conversations x 2 turns, 8 requests")
    add("--session-header", action="store_true", help=f"clients send {SESSION_HEADER}")
    add("--model", default="smollm2", help="name or folder (the bundled demo model)")
    add("--engines", type=int, default=3)
    add("--gateways", type=int, default=2)
    add("--slots", type=int, default=4, help="each engine's")
    add("--num-threads", type=int, default=1, help="each engine's compute threads")
    add("--max-model-len", type=int, default=2048)
    add(
        "--prefix-cache-rows",
        type=int,
        default=0,
        help="each engine's KV rows (>= --slots; spare rows keep finished prefixes); 0: the "
        "engine's default, one per slot",
    )
    add(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more flag or value for every engine, as is (repeat it: --engine-arg=--x "
        "--engine-arg=1)",
    )
    add("--conversations", type=int, default=12, help="chat")
    add("--wide-conversations", type=int, default=36, help="chat-wide")
    add("--turns", type=int, default=4)
    add("--message-tokens", type=int, default=300)
    add("--chat-new-tokens", type=int, default=32)
    add("--think", type=float, nargs=2, default=(0.3, 2.5), metavar=("MIN", "MAX"))
    add("--system-prompts", type=int, default=8)
    add("--system-tokens", type=int, default=1000)
    add("--system-requests", type=int, default=48)
    add("--system-clients", type=int, default=8)
    add("--system-new-tokens", type=int, default=16)
    add("--ignore-eos", action="store_true", help="every answer makes all its new tokens")
    add("--request-timeout", type=float, default=900.0, help="seconds, each request")
    add("--cell-timeout", type=float, default=3600.0, help="seconds, each workload run")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.wide_conversations, args.turns = 2, 4, 2
        # Two system prompts, so the 8 requests share some.
        args.system_prompts, args.system_requests, args.system_clients = 2, 8, 4
    return args


def engine_flags(args: argparse.Namespace, routing: str) -> tuple[str, ...]:
    """The flags a routing's engines get beyond the spec's own fields."""
    flags = [*args.engine_arg]
    if args.prefix_cache_rows and routing != "today":
        flags += ["--prefix-cache-rows", str(args.prefix_cache_rows)]
    return tuple(flags)


def main(argv: list[str] | None = None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    asked = [r for r in args.routings.split(",") if r]
    routings = [r for r in ROUTINGS if r in asked]  # prefix last: the ratios are prefix / each
    workloads = [w for w in args.workloads.split(",") if w]
    if bad := [r for r in asked if r not in ROUTINGS] + [
        w for w in workloads if w not in WORKLOADS
    ]:
        print(f"unknown routing or workload: {', '.join(bad)}")
        return 2
    notes = []
    if not routing_known():
        routings = [r for r in routings if r in ("today", "load")]
        notes.append(
            "the installed gateway's PoolConfig has no 'routing' field (issue 29 not in yet): "
            "ran today's routing only, with no routing block in the pool file"
        )
        print("NOTE: " + notes[-1])
    cpu = cpu_info(read_cpuinfo())
    load_at_start = load_average()
    code = code_state()
    dirty = (
        f", {len(code['changed_files'])} tracked files changed since"
        if code["changed_files"]
        else ""
    )
    print(f"code at {code['commit']}{dirty}")
    print(f"CPU {cpu['model']} x{cpu['cpu_count']}, flags {' '.join(cpu['flags'])}")
    print(f"load average at start {load_at_start}")
    from transformers import AutoTokenizer  # slow to import: after the arguments are checked

    model_dir = resolve_model(args.model, show_progress=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = EngineSpec(
        str(model_dir),
        MODEL_NAME,
        args.slots,
        args.num_threads,
        args.max_model_len,
        (),
    )
    started = time.monotonic()
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {r: [] for r in routings} for w in workloads
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        stack = PoolStack(redis, spec, args.engines, args.gateways, args.out / "logs")
        stack.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for repeat in range(args.repeats):
                order = routings if repeat % 2 == 0 else routings[::-1]
                for workload in workloads:
                    inputs = workload_inputs(workload, tokenizer, args)
                    for routing in order:
                        label = f"{workload}-{routing}-{repeat}"
                        print(f"[{time.monotonic() - started:6.0f} s] {label}: starting the pool")
                        block = ROUTINGS[routing] if routing_known() else None
                        stack.engine = replace(spec, extra_flags=engine_flags(args, routing))
                        stack.start(block, label)
                        try:
                            run = asyncio.run(measure(stack, workload, inputs, args))
                        finally:
                            stack.stop()
                        cell = summarize(run, tokenizer)
                        cell["load_average_end"] = load_average()
                        cells[workload][routing].append(cell)
                        print(
                            f"[{time.monotonic() - started:6.0f} s] {label}: "
                            f"{cell['completed']}/{cell['sent']} done in {cell['wall_s']:.0f} s "
                            f"({cell['num_errors']} errors), "
                            f"hit share {cell['hit_share']:.1%} of ideal {cell['ideal_share']:.1%}"
                        )
                        by_turn = cell["hit_of_ideal_by_turn"]
                        turns = ", ".join(
                            f"{turn} {share:.2f}" for turn, share in by_turn.items() if share
                        )
                        missed = cell["missed_turns"]
                        print(f"    served / ideal by turn: {turns}; {missed} under half the ideal")
        finally:
            stack.stop()
            redis.stop()
    for workload in workloads:
        print_table(workload, cells[workload])
    load_at_end = load_average()
    total_s = time.monotonic() - started
    print(f"\nCPU {cpu['model']} x{cpu['cpu_count']}, flags {' '.join(cpu['flags'])}")
    print(f"load average at start {load_at_start}, at end {load_at_end}; run {total_s:.0f} s")
    for note in notes:
        print("NOTE: " + note)
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "routings": routings,
        "routing_blocks": {r: ROUTINGS[r] for r in routings} if routing_known() else {},
        "notes": notes,
        "code": code,
        "cpu": cpu,
        "load_average_start": load_at_start,
        "load_average_end": load_at_end,
        "run_s": total_s,
        "cells": cells,
        "targets": {w: target_checks(w, cells[w]) for w in workloads},
    }
    path = args.out / "results.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
