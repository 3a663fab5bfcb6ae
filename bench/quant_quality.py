"""Quantization quality: a candidate model vs the fp32 reference, teacher-forced on a fixed text.

    .venv/bin/python bench/quant_quality.py --model smollm2 --quantization int8 int4

The text (``bench/data/quality_text.txt``, public domain) is tokenized once and cut into windows
of at most ``--window`` tokens (and the model's positions). Both models read every window with a
plain Hugging Face forward pass (no engine), and at each position:

- top-1 agreement: the candidate's argmax equals the reference's;
- perplexity: exp of the mean negative log-likelihood of the text's next token, per model.

A window is fed ``--step`` tokens a call, its KV cache carried over: every matrix product has at
most that many rows, as in a decode step, so a quantized model is measured on the kernels that
decode runs; and logits over the vocabulary (49,152 for SmolLM2) are held for one step at a time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from slotserve.engine.core.openmp import openmp_environment

os.environ.update(openmp_environment())  # libgomp reads it when torch loads

import torch
from rich.console import Console
from rich.table import Table

from bench.lib.kv_simulate import MODES as KV_MODES
from bench.lib.kv_simulate import simulated_kv
from bench.lib.output import line_buffered_stdout
from bench.lib.quality import (
    DEFAULT_TEXT,
    STEP,
    THRESHOLDS,
    QualityResult,
    compare,
    effective_window,
    engine_score,
    load_bf16_prefill,
    load_engine,
    load_quantized,
    score,
    text_token_ids,
)


def quality_table(rows: dict[str, QualityResult]) -> Table:
    table = Table(title="quantization quality vs fp32, teacher-forced")
    for col in ("mode", "top-1 agreement", "ppl fp32", "ppl mode", "ppl increase", "target"):
        table.add_column(col, justify="right")
    for mode, result in rows.items():
        verdict = result.passes(mode)
        target = "-"
        if verdict is not None:
            min_agreement, max_increase = THRESHOLDS[mode]
            mark = "[green]pass[/]" if verdict else "[red]FAIL[/]"
            target = f"≥{min_agreement:.0%}, ≤{max_increase:.1%}: {mark}"
        table.add_row(
            mode,
            f"{result.top1_agreement:.2%}",
            f"{result.reference_perplexity:.5g}",
            f"{result.candidate_perplexity:.5g}",
            f"{result.perplexity_increase:+.2%}",
            target,
        )
    return table


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slotserve.models.resolve import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="name, folder or hub id")
    parser.add_argument("--quantization", nargs="*", default=["int8", "int4"])
    parser.add_argument(
        "--prefill-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="bfloat16: also score bf16 prefill products (--prefill-step tokens a call)",
    )
    parser.add_argument("--prefill-step", type=int, default=256, help="tokens a call, bf16")
    parser.add_argument(
        "--engine",
        nargs="*",
        choices=["float32", "bfloat16", "int16"],
        default=[],
        help="also score a slotserve engine with these product dtypes (prefill and decode; "
        "int16 where the kernels run AVX2 or AVX512_VNNI), --step and --prefill-step tokens a "
        "step: the engine's own kernels, bf16 and int16 ones included",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=["float32", "float16"],
        default=["float32"],
        help="each --engine dtype with each of these KV caches (float16: the default where the "
        "native kernels run)",
    )
    parser.add_argument(
        "--engine-quantization",
        choices=["none", "int8", "int4"],
        default="none",
        help="the --engine engines' weights (int8/int4: held to those weights' bars)",
    )
    parser.add_argument(
        "--simulate-kv",
        nargs="*",
        choices=sorted(KV_MODES),
        default=[],
        help="also score the fp32 model reading its keys and values as a cache of these formats "
        "would hold them (bench/lib/kv_simulate.py; a cache format would be a default: the 99%% "
        "bar)",
    )
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--step", type=int, default=STEP, help="tokens per forward call")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("results/quant_quality.json"))
    args = parser.parse_args(argv)
    line_buffered_stdout()
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    token_ids = text_token_ids(tokenizer, args.text)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    window = effective_window(reference, args.window)
    print(f"{len(token_ids)} tokens of {args.text}, windows of {window}, {args.step} a call")
    ref_scores = score(reference, token_ids, window, args.step)
    rows: dict[str, QualityResult] = {}
    for mode in args.quantization:
        candidate, _, seconds = load_quantized(source, mode)
        rows[mode] = compare(ref_scores, score(candidate, token_ids, window, args.step))
        print(f"  {mode}: loaded and quantized in {seconds:.1f} s")
        del candidate
    for kv_mode in args.simulate_kv:
        with simulated_kv(kv_mode):
            rows[f"kv-{kv_mode}"] = compare(
                ref_scores, score(reference, token_ids, window, args.step)
            )
    if args.prefill_dtype == "bfloat16":
        candidate, seconds = load_bf16_prefill(source)
        prefill_ref = score(reference, token_ids, window, args.prefill_step)
        rows["bf16-prefill"] = compare(
            prefill_ref, score(candidate, token_ids, window, args.prefill_step)
        )
        print(f"  bf16-prefill: {args.prefill_step} tokens a call, loaded in {seconds:.1f} s")
        del candidate
    prefill_scores = score(reference, token_ids, window, args.prefill_step) if args.engine else None
    for dtype, kv, (label, step) in itertools.product(
        args.engine, args.kv_cache_dtype, (("", args.step), ("-prefill", args.prefill_step))
    ):
        reference_scores = ref_scores if step == args.step else prefill_scores
        assert reference_scores is not None
        engine, seconds = load_engine(
            str(source), dtype, window, step, kv, quantization=args.engine_quantization
        )
        kv_label = "-kv16" if kv == "float16" else ""
        weights = "" if args.engine_quantization == "none" else f"{args.engine_quantization}-"
        short = {"bfloat16": "bf16", "int16": "int16"}.get(dtype, "fp32")
        mode = f"engine-{weights}{short}{kv_label}{label}"
        rows[mode] = compare(reference_scores, engine_score(engine, token_ids, window, step))
        print(f"  {mode}: {step} tokens a step, loaded in {seconds:.1f} s")
        del engine
    Console(width=120).print(quality_table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "text": str(args.text), "quality": rows}
    args.out.write_text(json.dumps(report, indent=2, default=asdict))
    print(f"wrote {args.out}")
    return 0 if all(r.passes(m) is not False for m, r in rows.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
