"""Overlapped decode steps on a CPU: the static step with overlap, without, and the classic step.

    .venv/bin/python bench/overlap_bench.py [--model smollm2] [--batches 1 8] [--rounds 3]

Decode tokens/s (prefill excluded) of ``batch`` copies of one prompt, greedy, for: the classic
decode step (the CPU default: the native C step), the static step (eager) and the same static
engine with overlapped steps (``--overlap-steps on``). The static sides share one engine and
alternate with the classic one round by round (each round in another order) in one process, so
the ratios hold on a busy machine; best and median of the rounds, and the median of the rounds'
overlap/static ratios; the load average is read at the start and the end. Overlap's tokens
are checked against the static step's. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

from slotserve.engine.core.openmp import openmp_environment

os.environ.update(openmp_environment())  # libgomp reads it when torch loads
from pathlib import Path
from typing import Any

import torch

from bench.lib.engine import decode_prompt, greedy
from bench.lib.output import line_buffered_stdout
from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.model.loader import find_kernels, load_model
from slotserve.engine.core.model.prepare import prepare_model
from slotserve.engine.core.model.runner import ModelRunner
from slotserve.engine.settings import EngineSettings
from slotserve.models.resolve import resolve_model
from slotserve.settings import CommonSettings

MAX_MODEL_LEN = 512
REQUEST_IDS = itertools.count()


def load_average() -> list[float]:
    return [float(value) for value in Path("/proc/loadavg").read_text().split()[:3]]


def build(source: str, batch: int, decode_step: str) -> LLMEngine:
    """An engine of its own model copy (the runners rewrite the model's layers differently)."""
    model, tokenizer = load_model(source, torch.device("cpu"), torch.float32)
    settings = EngineSettings(
        model="bench",
        max_batch_size=batch,
        max_batched_tokens=batch * 256,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=False,
        decode_step=decode_step,  # type: ignore[arg-type]
    )
    kernels = find_kernels(torch.device("cpu"), torch.float32, CommonSettings().home)
    prepared = prepare_model(
        model,
        kernels,
        max_rows=batch,
        decode_step=decode_step,  # type: ignore[arg-type]
    )
    runner = ModelRunner(
        prepared,
        num_slots=batch,
        max_model_len=MAX_MODEL_LEN,
        overlap_steps=decode_step != "classic",  # switched per run on the static engine
    )
    return LLMEngine(
        settings, runner, tokenizer, kv_cache_tokens=batch * MAX_MODEL_LEN, model_name="bench"
    )


def decode_rate(
    engine: LLMEngine, batch: int, new_tokens: int, prompt: list[int]
) -> tuple[float, list[int]]:
    seqs = [
        engine.add_request(f"o{next(REQUEST_IDS)}", prompt, greedy(new_tokens))
        for _ in range(batch)
    ]
    engine.step()  # every prefill and first token
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(output.token_ids) for output in engine.step())
    return num_tokens / (time.perf_counter() - start), seqs[0].generated_token_ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="best of N per side")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("bench/results/overlap.json"))
    args = parser.parse_args(argv)
    line_buffered_stdout()
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    prompt = decode_prompt(args.prompt_tokens)
    report: dict[str, Any] = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "load_average_start": load_average(),
        "rows": [],
    }
    print(f"load average at start: {report['load_average_start']}")
    header = (
        f"{'batch':>5} {'classic tok/s':>14} {'static':>9} {'+overlap':>9} "
        f"{'overlap/static':>15} {'overlap/classic':>16} {'=static':>8}"
    )
    print(header)
    print("-" * len(header))
    for batch in args.batches:
        classic = build(source, batch, "classic")
        static = build(source, batch, "static")
        stepper = static.overlap
        rates: dict[str, list[float]] = {"classic": [], "static": [], "overlap": []}
        tokens: dict[str, list[int]] = {}
        decode_rate(classic, batch, 4, prompt)  # warm-up (calibration, first pages)
        decode_rate(static, batch, 4, prompt)
        sides = list(rates)
        for round_index in range(args.rounds):
            # Each round in another order: no side always runs right after the same one.
            for side in sides[round_index % 3 :] + sides[: round_index % 3]:
                engine = classic if side == "classic" else static
                if side != "classic":
                    static.overlap = stepper if side == "overlap" else None
                rate, tokens[side] = decode_rate(engine, batch, args.new_tokens, prompt)
                rates[side].append(rate)
        best = {side: max(values) for side, values in rates.items()}
        row = {
            "batch": batch,
            **{f"{side}_tok_s": rate for side, rate in best.items()},
            **{f"{side}_all_tok_s": values for side, values in rates.items()},
            **{f"{side}_median_tok_s": statistics.median(v) for side, v in rates.items()},
            "overlap_over_static": best["overlap"] / best["static"],
            "overlap_over_static_median": statistics.median(
                o / s for o, s in zip(rates["overlap"], rates["static"], strict=True)
            ),
            "overlap_over_classic": best["overlap"] / best["classic"],
            "static_over_classic": best["static"] / best["classic"],
            "overlap_tokens_equal_static": tokens["overlap"] == tokens["static"],
            "chained_steps": stepper.num_chained if stepper is not None else 0,
        }
        report["rows"].append(row)
        print(
            f"{batch:>5} {best['classic']:>14.1f} {best['static']:>9.1f} {best['overlap']:>9.1f} "
            f"{row['overlap_over_static']:>14.2f}x {row['overlap_over_classic']:>15.2f}x "
            f"{row['overlap_tokens_equal_static']!s:>8}"
        )
        del classic, static
    report["load_average_end"] = load_average()
    print(f"load average at end: {report['load_average_end']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
