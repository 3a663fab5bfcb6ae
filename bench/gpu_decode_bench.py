"""GPU decode check: random Llama configs in bf16, our engine vs HF generate() vs the HBM bound.

    bash bench/gpu_check.sh                                   # on a CUDA machine (docs/engine.md)
    .venv/bin/python bench/gpu_decode_bench.py --dry-run      # the same code on CPU, tiny config

For a ~1B and a ~8B Llama (Llama-3-8B's shape), initialised at random on the device (nothing is
downloaded), it measures decode tokens/s at each batch size for HF ``generate()`` (greedy,
``min_new_tokens`` so nothing stops early, prefill subtracted; eager with its dynamic cache, and
with a static cache, which transformers compiles) and for our engine stepping in-process with
the static decode step compiled into CUDA graphs (``--decode-step compiled``) and the same step
eager (``static``: graphs off), each with overlapped steps (``--overlap-steps on``: step N+1
launched before step N is postprocessed) and without, on the same engine, and sets them
against the bound that reading the weights and KV rows once per step at the measured copy
bandwidth allows. Our batch-1 tokens are checked against HF's (the equal prefix is reported:
bf16 sums in another order may flip a near-tie of a random model), and overlap's against the
same engine's without it (``*_tokens_equal_plain``). Prints a table and writes JSON (after
each model, so a run cut short keeps what it measured). Without CUDA it prints one line and
exits 2, unless ``--dry-run`` (CPU, both of our sides eager: inductor's CPU compile would take
most of the test's time).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback

from slotserve.engine.core.openmp import openmp_environment

os.environ.update(openmp_environment())  # libgomp reads it when torch loads (dry-run on CPU)
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from bench.lib.engine import Bench, hf_generate
from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.model.prepare import PreparedModel, is_static, prepare_model
from slotserve.engine.core.model.runner import ModelRunner, ModelShape
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.settings import EngineSettings

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 32000,
    },
    # Llama-3-8B's shape.
    "llama-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
    },
}
NOMINAL_H200_BYTES_S = 4.8e12  # the datasheet's HBM3e bandwidth
EOS_ID = 2  # LlamaConfig's default; both sides are told to ignore it


def default_out() -> Path:
    out = os.environ.get("OUT")  # the device tool's folder that comes back
    return Path(out) / "gpu_check.json" if out else Path("bench/results/gpu_check.json")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, num_bytes: int, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first-touch pages and the copy kernel
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    synchronize(device)
    elapsed = time.perf_counter() - start
    del src, dst
    return 2 * num_bytes * iters / elapsed


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A fast tokenizer of ``vocab_size`` words: the engine detokenizes every step, as it would
    a real model's output, without a download."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="w0", pad_token="w0", eos_token=f"w{EOS_ID}"
    )


def build_model(shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    config = LlamaConfig(
        **shape,
        max_position_embeddings=2048,
        tie_word_embeddings=False,  # as Llama-3-8B; the output layer is read every step
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    # Built on the device directly: initialising 8B parameters on the host takes minutes.
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to(device)
    return model.eval()


def best_rate(measure: Any, repeats: int) -> float:
    return max(measure() for _ in range(repeats))


def hf_tokens(bench: Bench, new_tokens: int, prompt: list[int]) -> list[int]:
    """HF generate()'s greedy tokens for one copy of the prompt (the reference for ours)."""
    ids = torch.tensor([prompt], device=bench.device)
    with torch.inference_mode():
        out = bench.hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def prepared_for(bench: Bench, decode_step: str) -> PreparedModel:
    """``bench.model`` prepared once for both sides: each runs the static step (compiled or
    eager) on the model's stock layers, so they differ only in the step their runner builds."""
    if not is_static(decode_step):
        raise SystemExit(f"--graphs-on/--graphs-off: static or compiled, not {decode_step}")
    if bench.prepared is None:
        bench.prepared = prepare_model(
            bench.model,
            None,
            max_rows=1,
            decode_step=decode_step,  # type: ignore[arg-type]
        )
    return dataclasses.replace(bench.prepared, decode_step=decode_step)  # type: ignore[arg-type]


def ours_engine(
    bench: Bench, batch: int, prompt_len: int, decode_step: str
) -> tuple[LLMEngine, ModelRunner]:
    """One engine per batch and side, reused across its runs: a compiled step is compiled for
    this runner's buffers once, on the warm-up run (the runner's own warm-up of every bucket is
    skipped: a benchmark at one batch size uses one bucket)."""
    settings = EngineSettings(
        model="bench",
        max_batch_size=batch,
        max_batched_tokens=batch * prompt_len,
        max_model_len=1024,
        enable_prefix_caching=False,
        decode_step=decode_step,  # type: ignore[arg-type]
    )
    runner = ModelRunner(
        prepared_for(bench, decode_step),
        num_slots=batch,
        max_model_len=1024,
        static_warm_up=False,
        overlap_steps=True,  # measure_ours switches it off and on: one compile serves both
    )
    engine = LLMEngine(
        settings, runner, bench.tokenizer, kv_cache_tokens=batch * 1024, model_name="bench"
    )
    return engine, runner


def ours_run(
    engine: LLMEngine, device: torch.device, batch: int, new_tokens: int, prompt: list[int]
) -> tuple[float, list[int]]:
    """Decode tokens/s of ``batch`` copies (prefill excluded) and the first copy's tokens."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(f"g{i}", prompt, params) for i in range(batch)]
    engine.step()  # every prefill and first token
    synchronize(device)
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(out.token_ids) for out in engine.step())
    synchronize(device)
    return num_tokens / (time.perf_counter() - start), seqs[0].generated_token_ids


def equal_prefix(ours: list[int], theirs: list[int]) -> int:
    count = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        count += 1
    return count


def measure_hf(bench: Bench, row: dict, key: str, args: argparse.Namespace) -> None:
    batch, new, prompt_ids = row["batch"], args.new_tokens, bench.prompt_ids
    try:
        # Warm-up. A static cache is sized by the generate's length, and each size is compiled
        # anew: warm the measured one.
        hf_generate(bench, batch, new if key == "hf_static" else 2, prompt_ids)

        def hf_rate() -> float:
            # Prefill dropped: a long generate minus a one-token one.
            first = hf_generate(bench, batch, 1, prompt_ids)
            full = hf_generate(bench, batch, new, prompt_ids)
            return batch * (new - 1) / max(1e-9, full - first)

        row[f"{key}_tok_s"] = best_rate(hf_rate, args.repeats)
    except Exception as error:  # record it and go on: the other sides may still run
        traceback.print_exc()
        row[f"{key}_error"] = f"{type(error).__name__}: {error}"


def measure_ours(
    bench: Bench, row: dict, keys: tuple[str, str], step: str, args: argparse.Namespace
) -> dict[str, list[int]]:
    """``keys``: the row keys of the overlapped side and the plain one; the two alternate on
    one engine (repeat by repeat), so they share its compiled graphs and the machine's mood."""
    batch, prompt_ids = row["batch"], bench.prompt_ids
    tokens: dict[str, list[int]] = {}
    try:
        engine, runner = ours_engine(bench, batch, len(prompt_ids), step)
        overlap = engine.overlap
        ours_run(engine, bench.device, batch, 4, prompt_ids)  # warm-up: compiles the bucket
        rates: dict[str, list[float]] = {key: [] for key in keys}
        for _ in range(args.repeats):
            for key, stepper in zip(keys, (overlap, None), strict=True):
                engine.overlap = stepper
                rate, tokens[key] = ours_run(
                    engine, bench.device, batch, args.new_tokens, prompt_ids
                )
                rates[key].append(rate)
        for key in keys:
            row[f"{key}_tok_s"] = max(rates[key])
            row[f"{key}_ms_per_step"] = 1e3 * batch / row[f"{key}_tok_s"]
        if overlap is not None:
            row[f"{keys[0]}_chained_steps"] = overlap.num_chained
        static = runner.static
        if static is not None:
            row[f"{keys[0]}_compiles"] = static.stats.num_compiles
            row[f"{keys[0]}_compile_s"] = static.stats.compile_seconds
            row[f"{keys[0]}_compile_failures"] = static.stats.num_compile_failures
    except Exception as error:
        traceback.print_exc()
        for key in keys:
            row[f"{key}_error"] = f"{type(error).__name__}: {error}"
    gc.collect()  # the engine holds a runner and its KV rows
    return tokens


def bench_model(name: str, args: argparse.Namespace, device: torch.device, bw: float) -> dict:
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = CONFIGS[name]
    start = time.perf_counter()
    model = build_model(shape, device, dtype)
    synchronize(device)
    init_s = time.perf_counter() - start
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    # A decode step gathers a few embedding rows and reads every other weight once.
    step_weight_bytes = weight_bytes - embedding.numel() * embedding.element_size()
    kv_bytes_per_token = ModelShape.from_config(model.config).kv_bytes_per_token(dtype)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, shape["vocab_size"], (args.prompt_tokens,), generator=generator)
    bench = Bench(model, word_tokenizer(shape["vocab_size"]), model, prompt.tolist(), device)
    report: dict[str, Any] = {
        "name": name,
        "config": shape,
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": weight_bytes,
        "step_weight_bytes": step_weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "init_s": init_s,
        "hf_attn_implementation": model.config._attn_implementation,
        "ours_decode_step": args.graphs_on,  # ours: overlap on; ours_nooverlap: off
        "ours_nographs_decode_step": args.graphs_off,  # ours_nographs_overlap: overlap on
        "rows": [],
    }
    print(
        f"{name}: {report['params'] / 1e9:.2f}B params, {weight_bytes / 1e9:.1f} GB, "
        f"built in {init_s:.1f} s"
    )
    rows = [{"batch": batch} for batch in args.batches]
    # HF first: the runner switches the model's attention to its slot attention for good.
    reference = hf_tokens(bench, args.new_tokens, bench.prompt_ids)
    for row in rows:
        measure_hf(bench, row, "hf_generate", args)
    sides = (
        (("ours", "ours_nooverlap"), args.graphs_on),
        (("ours_nographs_overlap", "ours_nographs"), args.graphs_off),
    )
    for row in rows:
        for keys, step in sides:
            if time.perf_counter() > args.deadline:
                for key in keys:
                    row[f"{key}_error"] = "skipped: past --budget-s"
                continue
            tokens = measure_ours(bench, row, keys, step, args)
            for key in keys:
                if row["batch"] == args.batches[0] and tokens.get(key):
                    # bf16 products in another order may flip a near-tie: the equal prefix.
                    row[f"{key}_tokens_equal_hf"] = equal_prefix(tokens[key], reference)
            if tokens.get(keys[0]) and tokens.get(keys[1]):
                # Overlap changes when the host reads a token, never which token it is.
                row[f"{keys[0]}_tokens_equal_plain"] = tokens[keys[0]] == tokens[keys[1]]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.hf_static_cache:
        # Last, on a fresh copy (same seed, same weights): ours changed this one's attention
        # and fused its products. transformers compiles the forward when the cache is static.
        del bench, model
        gc.collect()
        fresh = build_model(shape, device, dtype)
        fresh.generation_config.cache_implementation = "static"
        bench = Bench(fresh, word_tokenizer(shape["vocab_size"]), fresh, prompt.tolist(), device)
        for row in rows:
            if time.perf_counter() > args.deadline:
                row["hf_static_note"] = "skipped: past --budget-s"
            else:
                measure_hf(bench, row, "hf_static", args)
        del bench, fresh
    mean_context = args.prompt_tokens + args.new_tokens / 2
    for row in rows:
        batch = row["batch"]
        step_bytes = step_weight_bytes + batch * kv_bytes_per_token * mean_context
        row["bound_step_ms"] = 1e3 * step_bytes / bw
        row["bound_tok_s"] = batch * bw / step_bytes
        if device.type == "cuda":
            row["bound_nominal_tok_s"] = batch * NOMINAL_H200_BYTES_S / step_bytes
        sides_measured = ("ours", "ours_nooverlap", "ours_nographs", "ours_nographs_overlap")
        for side in (*sides_measured, "hf_generate", "hf_static"):
            if f"{side}_tok_s" in row:
                row[f"{side}_fraction_of_bound"] = row[f"{side}_tok_s"] / row["bound_tok_s"]
        if "ours_tok_s" in row and "hf_generate_tok_s" in row:
            row["ratio"] = row["ours_tok_s"] / row["hf_generate_tok_s"]
        report["rows"].append(row)
    report["new_tokens_checked"] = args.new_tokens
    return report


def fmt(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def print_table(models: list[dict], new_tokens: int) -> None:
    # ours: graphs and overlap on; then overlap off; graphs off (overlap off, then on).
    header = (
        f"{'model':<9} {'batch':>5} {'ours tok/s':>11} {'no overlap':>11} {'no graphs':>10} "
        f"{'ng+overlap':>11} {'HF tok/s':>9} {'HF static':>10} {'ours/HF':>8} "
        f"{'bound tok/s':>12} {'ours/bound':>10} {'ours ms/step':>13} {'=HF':>6}"
    )
    print(header)
    print("-" * len(header))
    for model in models:
        for row in model.get("rows", []):
            equal = row.get("ours_tokens_equal_hf")
            print(
                f"{model['name']:<9} {row['batch']:>5} {fmt(row, 'ours_tok_s', '11.1f')} "
                f"{fmt(row, 'ours_nooverlap_tok_s', '11.1f')} "
                f"{fmt(row, 'ours_nographs_tok_s', '10.1f')} "
                f"{fmt(row, 'ours_nographs_overlap_tok_s', '11.1f')} "
                f"{fmt(row, 'hf_generate_tok_s', '9.1f')} {fmt(row, 'hf_static_tok_s', '10.1f')} "
                f"{fmt(row, 'ratio', '7.2f')}x {fmt(row, 'bound_tok_s', '12.1f')} "
                f"{fmt(row, 'ours_fraction_of_bound', '10.1%')} "
                f"{fmt(row, 'ours_ms_per_step', '13.2f')} "
                f"{'-' if equal is None else f'{equal}/{new_tokens}':>6}"
            )
        if "error" in model:
            print(f"{model['name']:<9} {model['error']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: see docs)")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny config, batch 1/2: tests the script"
    )
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2, help="best of N per side")
    parser.add_argument(
        "--hf-static-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also HF generate() with a static cache, compiled (default: on CUDA)",
    )
    parser.add_argument("--graphs-on", default=None, help="our side's --decode-step")
    parser.add_argument("--graphs-off", default="static", help="our eager side's --decode-step")
    parser.add_argument(
        "--budget-s", type=float, default=300.0, help="start no further model past this"
    )
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if args.dry_run:
        device = torch.device("cpu")
        args.models = args.models or ["tiny"]
        args.batches = args.batches or [1, 2]
        args.prompt_tokens = args.prompt_tokens or 16
        args.new_tokens = args.new_tokens or 8
        args.graphs_on = args.graphs_on or "static"
        args.hf_static_cache = bool(args.hf_static_cache)
        copy_bytes = 1 << 25
    else:
        if not torch.cuda.is_available():
            print(
                f"gpu_decode_bench: no CUDA device (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda}); run it on a GPU machine, or pass --dry-run"
            )
            return 2
        device = torch.device("cuda")
        args.models = args.models or ["llama-1b", "llama-8b"]
        args.batches = args.batches or [1, 32]
        args.prompt_tokens = args.prompt_tokens or 128
        args.new_tokens = args.new_tokens or 64
        args.graphs_on = args.graphs_on or "compiled"
        args.hf_static_cache = args.hf_static_cache is not False
        copy_bytes = 1 << 32
    out: Path = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    args.deadline = started + args.budget_s
    bw = copy_bandwidth(device, copy_bytes)
    report: dict[str, Any] = {
        "dry_run": args.dry_run,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": "float32" if device.type == "cpu" else "bfloat16",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "copy_bandwidth_bytes_s": bw,
        "nominal_bandwidth_bytes_s": NOMINAL_H200_BYTES_S if device.type == "cuda" else None,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "hf_cache": "dynamic",  # hf_generate_*; hf_static_* (when run) used a compiled static one
        "hf_static_cache": args.hf_static_cache,
        "models": [],
    }
    print(
        f"{report['device_name']}: copy bandwidth {bw / 1e12:.3f} TB/s (read + written); "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, best of {args.repeats}"
    )
    for name in args.models:
        if time.perf_counter() > args.deadline:
            report["models"].append({"name": name, "error": "skipped: past --budget-s"})
        else:
            try:
                report["models"].append(bench_model(name, args, device, bw))
            except Exception as error:  # e.g. out of memory: the next model may still fit
                traceback.print_exc()
                report["models"].append({"name": name, "error": f"{type(error).__name__}: {error}"})
            gc.collect()  # the model and its runners are garbage now; free them before the next
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["total_s"] = time.perf_counter() - started
        out.write_text(json.dumps(report, indent=2))
    print_table(report["models"], args.new_tokens)
    print(f"wrote {out} ({report['total_s']:.0f} s)")
    failed = [m["name"] for m in report["models"] if "error" in m] + [
        f"{m['name']} batch {row['batch']}"
        for m in report["models"]
        for row in m.get("rows", [])
        if {"hf_generate_error", "ours_error"} & set(row)
    ]
    if failed:
        print(f"gpu_decode_bench: errors in {', '.join(failed)} (see the JSON and traceback)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
