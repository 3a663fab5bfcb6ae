"""Weight-only quantization: decode speed and quality side by side, in one run.

    .venv/bin/python bench/quant_bench.py --model smollm2 [--quick] [--llama-cpp PEER.json]

For each quantization (none, int8, int4) the model is loaded fresh and quantized in place
(``slotserve.engine.core.model.quantize.quantize_model``); its weight bytes and load+quantize
seconds are recorded, and its quality against the fp32 model is measured on the shipped text
(``bench/quant_quality.py``: teacher-forced top-1 agreement and perplexity) before any engine
touches it. Then decode tokens/s at each batch size, 128-token prompts, greedy, EOS ignored: our
engine in-process with each model, and Hugging Face ``generate()`` in fp32 as the baseline,
alternated and best of ``--repeats`` (a busy moment on a shared machine should not decide a
ratio). ``--llama-cpp`` folds in a llama.cpp result (``bench/llamacpp_peer.py``'s JSON:
``tokens_per_s.batch_N``) measured in the same session.

Prints tables with issue 16's targets marked, and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slotserve.engine.core.openmp import openmp_environment

os.environ.update(openmp_environment())  # libgomp reads it when torch loads

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.lib.engine import Bench, decode_prompt, hf_decode_rate, interleaved_step_ms, ours_decode
from bench.lib.output import line_buffered_stdout
from bench.lib.quality import (
    DEFAULT_TEXT,
    STEP,
    THRESHOLDS,
    QualityResult,
    compare,
    effective_window,
    load_quantized,
    score,
    text_token_ids,
)
from slotserve.contracts.weights import Quantization
from slotserve.engine.core.kernels import load_kernels
from slotserve.models.resolve import resolve_model
from slotserve.settings import CommonSettings

MODES = ("none", "int8", "int4")
# (mode, batch, baseline, minimum ratio): issue 16's targets on decode tokens/s.
SPEED_TARGETS = (
    ("none", 1, "hf", 2.0),
    ("none", 32, "hf", 2.0),
    ("int8", 1, "hf", 4.0),
    ("int8", 1, "llama_cpp", 0.5),
    ("int4", 1, "llama_cpp", 1.0),
)
# fp32: a step with 4 sequences costs at most this much more than a step with 1.
STEP_RATIO_4_OVER_1 = 1.15


@dataclass
class ModeRun:
    mode: str
    load_quantize_s: float
    weight_bytes: int  # see weight_bytes(): fp32 parameters and buffers, packed weights
    quantized_bytes_before: int | None  # QuantizationReport: the layers it quantized
    quantized_bytes_after: int | None
    quality: QualityResult | None


def weight_bytes(model) -> int:
    """Bytes of the weights the model holds: its distinct parameters and buffers (tied ones
    once), plus each quantized layer's own count (``nbytes()``: its packed weights are plain
    attributes, and a fused q/k/v layer hangs off an object shared by three modules, outside
    the module tree)."""
    tensors = [*model.parameters(), *model.buffers()]
    sizes = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    layers: dict[int, Any] = {}  # quantized layers (each has nbytes())

    def quantized(obj: object) -> bool:
        return isinstance(obj, torch.nn.Module) and callable(getattr(obj, "nbytes", None))

    def plain(obj: object) -> bool:
        return hasattr(obj, "__dict__") and not isinstance(
            obj, torch.Tensor | torch.nn.Module | type
        )

    def visit(obj: object, depth: int) -> None:
        for value in vars(obj).values():
            if quantized(value):
                layers[id(value)] = value
            # Into plain objects only; tensors held as attributes may be activations kept for
            # reuse, not weights.
            elif depth < 3 and plain(value):
                visit(value, depth + 1)

    for module in model.modules():
        if quantized(module):
            layers[id(module)] = module
        visit(module, 0)
    return sum(sizes.values()) + sum(layer.nbytes() for layer in layers.values())


def read_llama_cpp(path: Path) -> dict[int, float]:
    """Tokens/s per batch size from a llama.cpp peer result (``tokens_per_s.batch_N``)."""
    rates = json.loads(path.read_text()).get("tokens_per_s", {})
    # Other figures share the prefix (batch_1_batch_api: batch 1 through the batch API).
    return {
        int(key.removeprefix("batch_")): float(value)
        for key, value in rates.items()
        if key.removeprefix("batch_").isdigit() and value is not None
    }


def load_modes(
    source: str, modes: list[Quantization], reference, token_ids: list[int], window: int
):
    """Each mode's model, loaded fresh and quantized, with its quality against ``reference``."""
    quantized = any(mode != "none" for mode in modes)
    ref_scores = score(reference, token_ids, window) if quantized else None
    models, runs = {}, []
    for mode in modes:
        model, report, seconds = load_quantized(source, mode)
        quality = None
        if mode != "none" and ref_scores is not None:
            quality = compare(ref_scores, score(model, token_ids, window))
        run = ModeRun(
            mode=mode,
            load_quantize_s=seconds,
            weight_bytes=weight_bytes(model),
            quantized_bytes_before=getattr(report, "bytes_before", None),
            quantized_bytes_after=getattr(report, "bytes_after", None),
            quality=quality,
        )
        line = f"  {mode:<5} {run.weight_bytes / 1e6:7.1f} MB, loaded+quantized in {seconds:5.1f} s"
        if quality is not None:
            line += (
                f", top-1 {quality.top1_agreement:.2%}, "
                f"ppl {quality.candidate_perplexity:.5g} ({quality.perplexity_increase:+.2%})"
            )
        print(line)
        models[mode] = model
        runs.append(run)
    return models, runs


def decode_rows(
    benches: dict[str, Bench], hf: Bench, batches: list[int], new_tokens: int, repeats: int
) -> list[dict]:
    prompt = decode_prompt()
    rows = []
    for batch in batches:
        best = {mode: 0.0 for mode in benches}
        hf_rate = 0.0
        for _ in range(repeats):
            hf_rate = max(hf_rate, hf_decode_rate(hf, batch, new_tokens, prompt))
            for mode, bench in benches.items():
                best[mode] = max(best[mode], ours_decode(bench, batch, new_tokens, prompt)[0])
        row = {"batch": batch, "hf_generate_fp32_tok_s": hf_rate}
        for mode, rate in best.items():
            row[f"{mode}_tok_s"] = rate
            row[f"{mode}_vs_hf"] = rate / hf_rate
        rows.append(row)
        cells = "   ".join(f"{m} {best[m]:7.1f} (x{best[m] / hf_rate:.2f})" for m in best)
        print(f"  batch {batch:>3}: HF fp32 {hf_rate:7.1f} tok/s   {cells}")
    return rows


def add_llama_cpp(rows: list[dict], llama: dict[int, float], modes: list[str]) -> None:
    for row in rows:
        theirs = llama.get(row["batch"])
        row["llama_cpp_tok_s"] = theirs
        for mode in modes:
            row[f"{mode}_vs_llama_cpp"] = row[f"{mode}_tok_s"] / theirs if theirs else None


def speed_targets(rows: list[dict], step_ms: dict[int, float] | None = None) -> list[dict]:
    """Issue 16's speed targets that this run can judge (ratio None: no baseline measured);
    ``step_ms``: fp32 ms per decode step by batch size, interleaved (bench/step_cost.py)."""
    by_batch = {row["batch"]: row for row in rows}
    targets = []
    for mode, batch, baseline, minimum in SPEED_TARGETS:
        row = by_batch.get(batch)
        if row is None or f"{mode}_tok_s" not in row:
            continue
        ratio = row.get(f"{mode}_vs_{baseline}")
        name = "HF generate() fp32" if baseline == "hf" else "llama.cpp"
        targets.append(
            {
                "target": f"{mode} batch {batch} ≥ {minimum:g}x {name}",
                "ratio": ratio,
                "pass": None if ratio is None else ratio >= minimum,
            }
        )
    if step_ms is not None and 1 in step_ms and 4 in step_ms:
        ratio = step_ms[4] / step_ms[1]
        targets.append(
            {
                "target": f"none step at batch 4 ≤ {STEP_RATIO_4_OVER_1:g}x the step at batch 1",
                "ratio": ratio,
                "pass": ratio <= STEP_RATIO_4_OVER_1,
            }
        )
    return targets


def verdict(value: bool | None) -> str:
    return "-" if value is None else "[green]pass[/]" if value else "[red]FAIL[/]"


def ppl_cell(mode: str, quality: QualityResult | None, fp32_ppl: float | None) -> str:
    if quality is not None:
        return f"{quality.candidate_perplexity:.5g}"
    return f"{fp32_ppl:.5g}" if mode == "none" and fp32_ppl is not None else "-"


def print_tables(console: Console, runs: list[ModeRun], rows: list[dict], targets: list[dict]):
    models = Table(title="models: weights, load+quantize, quality vs fp32 (teacher-forced)")
    for col in ("mode", "weights MB", "load+quantize s", "top-1", "ppl", "ppl increase", "target"):
        models.add_column(col, justify="right")
    fp32_ppl = next((r.quality.reference_perplexity for r in runs if r.quality), None)
    for run in runs:
        q = run.quality
        target = "-"
        if q is not None and run.mode in THRESHOLDS:
            agreement, increase = THRESHOLDS[run.mode]
            target = f"≥{agreement:.0%}, ≤{increase:.0%}: {verdict(q.passes(run.mode))}"
        models.add_row(
            run.mode,
            f"{run.weight_bytes / 1e6:.1f}",
            f"{run.load_quantize_s:.1f}",
            "-" if q is None else f"{q.top1_agreement:.2%}",
            ppl_cell(run.mode, q, fp32_ppl),
            "-" if q is None else f"{q.perplexity_increase:+.2%}",
            target,
        )
    console.print(models)
    modes = [run.mode for run in runs]
    llama = any(row.get("llama_cpp_tok_s") for row in rows)
    speed = Table(
        title="decode tokens/s (ratio vs HF generate() fp32" + (", vs llama.cpp)" if llama else ")")
    )
    speed.add_column("batch", justify="right")
    speed.add_column("HF fp32", justify="right")
    if llama:
        speed.add_column("llama.cpp", justify="right")
    for mode in modes:
        speed.add_column(f"ours {mode}", justify="right")
    for row in rows:
        cells = [str(row["batch"]), f"{row['hf_generate_fp32_tok_s']:.1f}"]
        if llama:
            theirs = row.get("llama_cpp_tok_s")
            cells.append("-" if not theirs else f"{theirs:.1f}")
        for mode in modes:
            cell = f"{row[f'{mode}_tok_s']:.1f} (x{row[f'{mode}_vs_hf']:.2f}"
            vs_llama = row.get(f"{mode}_vs_llama_cpp")
            cells.append(cell + (f", x{vs_llama:.2f})" if vs_llama else ")"))
        speed.add_row(*cells)
    console.print(speed)
    for goal in targets:
        ratio = "no baseline" if goal["ratio"] is None else f"x{goal['ratio']:.2f}"
        console.print(f"  {goal['target']}: {ratio} {verdict(goal['pass'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="name, folder or hub id")
    parser.add_argument("--quantization", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--batches", type=int, nargs="+", help="default 1 4 8 32 (1 4 with --quick)"
    )
    parser.add_argument(
        "--decode-tokens", type=int, help="new tokens (default 64, 16 with --quick)"
    )
    parser.add_argument(
        "--repeats", type=int, help="best of N per side (default 2, 1 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer batches, tokens and repeats")
    parser.add_argument("--window", type=int, default=1024, help="quality: tokens per window")
    parser.add_argument("--quality-tokens", type=int, help="quality: first N tokens of the text")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp peer result JSON to fold in")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("bench/results/quant_bench.json"))
    args = parser.parse_args(argv)
    line_buffered_stdout()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = args.batches or ([1, 4] if args.quick else [1, 4, 8, 32])
    new_tokens = args.decode_tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 2)
    source = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    # fp32 on the CPU: the quality reference and the HF generate() baseline.
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    token_ids = text_token_ids(tokenizer, DEFAULT_TEXT)[: args.quality_tokens]
    window = effective_window(reference, args.window)
    started = time.perf_counter()
    report: dict = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "batches": batches,
        "decode_tokens": new_tokens,
        "prompt_tokens": len(decode_prompt()),
        "repeats": repeats,
        "quality_text": DEFAULT_TEXT.name,
        "quality_tokens": len(token_ids),
        "quality_window": window,
        "quality_step": STEP,
        "load_average_at_start": os.getloadavg(),
        # Which instruction set the native kernels ran (the widest this CPU has).
        "native_kernels_isa": load_kernels(CommonSettings().home).isa,
    }
    print(f"native kernels: {report['native_kernels_isa']}")
    print(f"1. load, quantize, quality on {len(token_ids)} tokens (windows {window}, step {STEP})")
    models, runs = load_modes(source, args.quantization, reference, token_ids, window)
    device = torch.device("cpu")
    benches = {
        m: Bench(model, tokenizer, reference, [], device, slots=max(batches))
        for m, model in models.items()
    }
    hf = Bench(reference, tokenizer, reference, [], device)
    print(f"2. decode: 128-token prompts, {new_tokens} new tokens, best of {repeats}")
    rows = decode_rows(benches, hf, batches, new_tokens, repeats)
    step_ms = None
    if "none" in benches and 1 in batches and 4 in batches:
        # Tokens/s of one batch size after another moves with the machine; the step ratio is
        # measured with the sizes' steps interleaved.
        step_ms = interleaved_step_ms(benches["none"], [1, 4], new_tokens)
        report["fp32_step_ms_interleaved"] = step_ms
        print(f"  fp32 step, interleaved: batch 1 {step_ms[1]:.1f} ms, batch 4 {step_ms[4]:.1f} ms")
    del benches, models
    gc.collect()
    if args.llama_cpp:
        report["llama_cpp"] = json.loads(args.llama_cpp.read_text())
        add_llama_cpp(rows, read_llama_cpp(args.llama_cpp), args.quantization)
    targets = speed_targets(rows, step_ms)
    quality_targets = [
        {"target": f"{r.mode} quality", "pass": r.quality.passes(r.mode)}
        for r in runs
        if r.quality is not None
    ]
    print_tables(Console(width=150), runs, rows, targets)
    report.update(
        models=runs,
        decode=rows,
        targets=targets + quality_targets,
        total_s=time.perf_counter() - started,
        load_average_at_end=os.getloadavg(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=asdict))
    print(f"wrote {args.out} ({report['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
