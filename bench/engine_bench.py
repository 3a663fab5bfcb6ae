"""Engine benchmark: policies on the seed workload, Poisson arrivals, decode speed vs HF generate().

    .venv/bin/python bench/engine_bench.py --model smollm2 --out results/engine [--quick]

Everything runs in one process, side by side, so ratios are comparable on a shared machine.
Prints tables, writes ``results.json`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

from slotserve.engine.core.openmp import openmp_environment

os.environ.update(openmp_environment())  # libgomp reads it when torch loads
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from bench.lib.engine import (
    Bench,
    decode_prompt,
    greedy,
    hf_decode_rate,
    hf_generate,
    make_engine,
    ours_decode,
)
from bench.lib.output import line_buffered_stdout
from bench.lib.plots import plot_decode, plot_occupancy, plot_poisson
from slotserve.engine.core.model.loader import load_model, pick_device, pick_dtype
from slotserve.engine.core.stats import RequestMetrics
from slotserve.models.resolve import resolve_model

SEED_LENGTHS = (20, 50, 100, 500)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


# -- 1. the seed workload ------------------------------------------------------------------


def seed_workload(bench: Bench, lengths: tuple[int, ...], num_cycles: int, out: Path) -> dict:
    stream = [n for _ in range(num_cycles) for n in lengths]
    useful = sum(stream)
    rows: dict[str, dict[str, Any]] = {}
    records = {}
    for policy in ("static", "dynamic", "continuous"):
        engine = make_engine(bench, policy=policy, max_batch_size=4)
        start = time.perf_counter()
        results = engine.generate([bench.prompt_ids] * len(stream), [greedy(n) for n in stream])
        wall = time.perf_counter() - start
        assert [len(r.token_ids) for r in results] == stream
        stats = engine.stats()
        rows[policy] = {
            "wall_s": wall,
            "useful_tokens": useful,
            "useful_tok_s": useful / wall,
            "steps": stats.num_steps,
            "slot_utilisation": stats.slot_utilisation,
        }
        records[policy] = engine.step_records
        print(
            f"  {policy:<10} {wall:8.1f} s  {useful / wall:7.1f} tok/s  "
            f"util {stats.slot_utilisation:.1%}"
        )
    # HF static batches of 4 (one of each length): every batch runs to the longest request.
    # All batches are identical (same prompt, same lengths), so one is measured and the stream
    # time is that times the number of batches; likewise one request of each length alone.
    batch_s = hf_generate(bench, len(lengths), max(lengths))
    rows["hf_static_batches"] = {
        "wall_s": batch_s * num_cycles,
        "useful_tokens": useful,
        "useful_tok_s": useful / (batch_s * num_cycles),
        "steps": max(lengths) * num_cycles,
        "slot_utilisation": sum(lengths) / (len(lengths) * max(lengths)),
        "note": f"one batch measured ({batch_s:.1f} s), x{num_cycles} batches",
    }
    single_s = sum(hf_generate(bench, 1, n) for n in lengths)
    rows["hf_one_at_a_time"] = {
        "wall_s": single_s * num_cycles,
        "useful_tokens": useful,
        "useful_tok_s": useful / (single_s * num_cycles),
        "steps": sum(lengths) * num_cycles,
        "slot_utilisation": 1 / len(lengths),
        "note": f"one request of each length measured ({single_s:.1f} s), x{num_cycles}",
    }
    for name in ("hf_static_batches", "hf_one_at_a_time"):
        row = rows[name]
        print(
            f"  {name:<10} {row['wall_s']:8.1f} s  {row['useful_tok_s']:7.1f} tok/s  "
            f"({row['note']})"
        )
    plot_occupancy(records["static"], records["continuous"], 4, out / "seed_occupancy.png")
    continuous = rows["continuous"]["useful_tok_s"]
    return {
        "stream_output_lengths": stream,
        "rows": rows,
        "continuous_vs_hf_static": continuous / rows["hf_static_batches"]["useful_tok_s"],
        "continuous_vs_static": continuous / rows["static"]["useful_tok_s"],
    }


# -- 2. Poisson arrivals -------------------------------------------------------------------


def long_tailed_lengths(rng: random.Random, num: int, low: int, high: int) -> list[int]:
    """Log-uniform between low and high: many short answers, a few long ones."""
    return [round(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(num)]


def poisson_run(bench: Bench, rate: float, lengths: list[int], seed: int, policy: str) -> dict:
    rng = random.Random(seed)
    arrivals, clock = [], 0.0
    for _ in lengths:
        clock += rng.expovariate(rate)
        arrivals.append(clock)
    engine = make_engine(
        bench, policy=policy, max_batch_size=32, max_queue_delay_microseconds=50_000
    )
    start = time.perf_counter()
    engine.clock = lambda: time.perf_counter() - start
    metrics: list[RequestMetrics] = []
    next_index = 0
    while next_index < len(lengths) or engine.has_unfinished():
        now = engine.clock()
        while next_index < len(lengths) and arrivals[next_index] <= now:
            engine.add_request(f"p{next_index}", bench.prompt_ids, greedy(lengths[next_index]))
            next_index += 1
        delay = engine.next_step_delay()
        if delay > 0:
            wait = arrivals[next_index] - now if next_index < len(lengths) else delay
            time.sleep(max(0.0, min(delay, wait)))
            continue
        metrics.extend(out.metrics for out in engine.step() if out.finished and out.metrics)
    duration = engine.clock()
    ttft = [m.time_to_first_token for m in metrics]
    itl = [x for m in metrics for x in m.inter_token_latencies]
    tpot = [
        (m.e2e_latency - m.time_to_first_token) / len(m.inter_token_latencies)
        for m in metrics
        if m.inter_token_latencies
    ]
    return {
        "policy": policy,
        "rate_req_s": rate,
        "num_requests": len(lengths),
        "duration_s": duration,
        "request_throughput": len(lengths) / duration,
        "output_token_throughput": sum(lengths) / duration,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "tpot_p99_ms": percentile(tpot, 99) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
        "slot_utilisation": engine.stats().slot_utilisation,
    }


def poisson_workload(bench: Bench, rates: list[float], num: int, high: int, out: Path) -> list:
    lengths = long_tailed_lengths(random.Random(0), num, 16, high)
    rows = []
    # Static for contrast at the two highest rates only (it is slow by design).
    for policy, policy_rates in (("continuous", rates), ("static", rates[-2:])):
        for rate in policy_rates:
            row = poisson_run(bench, rate, lengths, seed=1, policy=policy)
            rows.append(row)
            print(
                f"  {policy:<10} {rate:5.2f} req/s  {row['request_throughput']:5.2f} req/s  "
                f"{row['output_token_throughput']:6.1f} tok/s  TTFT p50/p99 "
                f"{row['ttft_p50_ms']:7.0f}/{row['ttft_p99_ms']:7.0f} ms  TPOT p50/p99 "
                f"{row['tpot_p50_ms']:5.0f}/{row['tpot_p99_ms']:5.0f} ms  ITL p50/p99 "
                f"{row['itl_p50_ms']:5.0f}/{row['itl_p99_ms']:5.0f} ms"
            )
    plot_poisson(rows, out / "poisson_throughput_latency.png")
    return rows


# -- 3. decode speed -----------------------------------------------------------------------


def hf_generate_batch(bench: Bench, batch: int, new_tokens: int, prompt: list[int]) -> float:
    """Aggregate tokens/s of transformers' own continuous batching, prefill included."""
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    start = time.perf_counter()
    outputs = bench.hf_model.generate_batch(
        [prompt] * batch, generation_config=config, progress_bar=False, warmup=False
    )
    wall = time.perf_counter() - start
    return sum(len(out.generated_tokens) for out in outputs.values()) / wall


def decode_speed(
    bench: Bench, batches: list[int], new_tokens: int, repeats: int, out: Path
) -> list:
    prompt = decode_prompt()
    rows: list[dict[str, Any]] = []
    for batch in batches:
        # Best of `repeats` for each side, alternating: a busy moment on a shared machine
        # should not decide the ratio.
        ours = ours_with_prefill = hf = 0.0
        for _ in range(repeats):
            decode, with_prefill = ours_decode(bench, batch, new_tokens, prompt)
            ours, ours_with_prefill = max(ours, decode), max(ours_with_prefill, with_prefill)
            hf = max(hf, hf_decode_rate(bench, batch, new_tokens, prompt))
        rows.append(
            {
                "batch": batch,
                "ours_tok_s": ours,
                "hf_generate_tok_s": hf,
                "ratio": ours / hf,
                "ours_with_prefill_tok_s": ours_with_prefill,
            }
        )
        print(
            f"  batch {batch:>3}: ours {ours:7.1f} tok/s   HF generate {hf:7.1f} tok/s   "
            f"x{ours / hf:.2f}"
        )
    # transformers' continuous batching last: it switches the model to its paged attention.
    # A first small call warms it up (the measured calls skip its own warm-up).
    hf_generate_batch(bench, 1, 2, prompt)
    for row in rows:
        batch = row["batch"]
        theirs = hf_generate_batch(bench, batch, new_tokens, prompt)
        row["hf_generate_batch_tok_s"] = theirs
        row["ratio_vs_generate_batch"] = row["ours_with_prefill_tok_s"] / theirs
        print(
            f"  batch {batch:>3}, prefill included: ours {row['ours_with_prefill_tok_s']:7.1f} "
            f"tok/s   HF generate_batch {row['hf_generate_batch_tok_s']:7.1f} tok/s   "
            f"x{row['ratio_vs_generate_batch']:.2f}"
        )
    plot_decode(rows, out / "decode_tokens_per_second.png")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", type=Path, default=Path("results/engine"))
    parser.add_argument("--quick", action="store_true", help="short lengths, few requests")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--seed-scale",
        type=float,
        default=None,
        help="multiply the seed lengths 20/50/100/500 (default 1, or 0.2 with --quick)",
    )
    parser.add_argument("--only", choices=["seed", "poisson", "decode"], action="append")
    parser.add_argument("--rates", type=float, nargs="+", help="Poisson request rates (req/s)")
    parser.add_argument("--poisson-requests", type=int, help="requests per rate")
    parser.add_argument("--poisson-max-tokens", type=int, help="longest output (log-uniform)")
    parser.add_argument("--decode-tokens", type=int, help="new tokens in the decode test")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--decode-repeats", type=int, help="best of N per side (default 2, or 1 with --quick)"
    )
    args = parser.parse_args()
    line_buffered_stdout()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    device = pick_device("auto")
    dtype = pick_dtype("auto", device)
    source = resolve_model(args.model)
    model, tokenizer = load_model(source, device, dtype)
    # transformers types .to() for a model class, not for the auto class's result.
    hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    chat = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt_ids = list(tokenizer.encode(text, add_special_tokens=False))
    bench = Bench(model, tokenizer, hf_model, prompt_ids, device, slots=max(args.decode_batches))
    sections = set(args.only or ["seed", "poisson", "decode"])
    report: dict = {
        "model": args.model,
        "device": str(device),
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "prompt_tokens": len(prompt_ids),
        "load_average_at_start": os.getloadavg(),
    }
    started = time.perf_counter()
    if "seed" in sections:
        scale = args.seed_scale or (0.2 if args.quick else 1.0)
        lengths = tuple(max(1, round(n * scale)) for n in SEED_LENGTHS)
        print(f"1. seed workload: {lengths} x4 requests, max_batch_size 4, ignore EOS")
        report["seed"] = seed_workload(bench, lengths, 4, args.out)
    if "poisson" in sections:
        rates = args.rates or ([1.0, 4.0] if args.quick else [0.5, 1.0, 2.0, 4.0])
        num = args.poisson_requests or (12 if args.quick else 32)
        high = args.poisson_max_tokens or (64 if args.quick else 512)
        print(f"2. Poisson arrivals: {num} requests, output 16..{high} log-uniform, 32 slots")
        report["poisson"] = poisson_workload(bench, rates, num, high, args.out)
    if "decode" in sections:
        new_tokens = args.decode_tokens or (16 if args.quick else 64)
        repeats = args.decode_repeats or (1 if args.quick else 2)
        print(f"3. decode speed: 128-token prompts, {new_tokens} new tokens, best of {repeats}")
        report["decode"] = decode_speed(bench, args.decode_batches, new_tokens, repeats, args.out)
    report["total_s"] = time.perf_counter() - started
    report["load_average_at_end"] = os.getloadavg()
    (args.out / "results.json").write_text(json.dumps(report, indent=2, default=asdict))
    print(f"wrote {args.out / 'results.json'} and plots in {args.out} ({report['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
