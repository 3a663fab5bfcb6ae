"""Prefill throughput by path, the paths interleaved in one process on one model.

    .venv/bin/python -m bench.prefill_paths [--prompt-tokens 170 1000] [--rounds 3]

A prefill chunk can run several ways: in the native C step (fused small ops) with its own fp32
products, with bf16 products on the native kernels' packed weights (VDPBF16PS, where the
kernels run AVX512_BF16) or with bf16 GEMMs through torch's oneDNN (called back from the
step), or through the transformers modules with fp32 or either kind of bf16 products. Which is
fastest depends on the CPU (AMX, AVX512_BF16, L2 size) and on the prompt length, so this
measures them all on one engine, switching the path between runs and rotating their order each
round: a slow moment of a shared machine costs every path alike. Each run prefills 8 distinct
prompts of the given length (1 new token, no prefix cache). Prints prompt tokens/s (median over
rounds) and the ratio to the native fp32 step; ``--out`` writes JSON.

With ``--quantization int8`` or ``int4`` the model's layers are quantized and two paths are
compared: the native step's fp32 products on the unpacked weights, and its bf16 products on the
weights widened to bf16 as they are multiplied (``kernels/quantized_bf16.c``, where the kernels
run AVX512_BF16).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from slotserve.engine.core.openmp import openmp_environment

os.environ.update(openmp_environment())  # libgomp reads it when torch loads
from pathlib import Path

import torch

from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.kernels import pack_bf16
from slotserve.engine.core.model.bf16_decode import ISA
from slotserve.engine.core.model.bf16_prefill import bf16_units, decoder_linears
from slotserve.engine.core.model.native_linear import NativeLinear
from slotserve.engine.core.model.runner import ModelRunner
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.settings import EngineSettings
from slotserve.models.resolve import resolve_model

PATHS = (
    "native fp32", "native bf16 packed", "native bf16 onednn",
    "modules fp32", "modules bf16 packed", "modules bf16 onednn",
)  # fmt: skip
QUANTIZED_PATHS = ("native fp32", "native bf16")
NUM_PROMPTS = 8


def both_routes(engine: LLMEngine) -> dict[NativeLinear, torch.Tensor]:
    """Give every bf16 decoder layer both copies (plain for oneDNN, packed where the kernels
    run AVX512_BF16) and the native step both routes; returns the layers' plain copies."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.native_step is not None
    assert runner.bf16_gate is not None
    packed = runner.native_step.kernels.isa == ISA
    plain = {}
    for layer in decoder_linears(runner.model):
        if layer.weight_fp32 is None or layer.bf16_gate is not runner.bf16_gate:
            continue
        if layer.weight_bf16 is None:
            layer.weight_bf16 = layer.weight_fp32.to(torch.bfloat16)
        if packed and layer.weight_packed is None:
            layer.weight_packed = pack_bf16(layer.weight_fp32)
        plain[layer] = layer.weight_bf16
    runner.native_step.use_bf16_products(runner.bf16_gate)
    if packed:
        runner.native_step.use_packed_bf16(runner.bf16_gate)
    return plain


def set_path(engine: LLMEngine, path: str, plain: dict[NativeLinear, torch.Tensor]) -> None:
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.native_step is not None
    runner.prefill_bf16 = "bf16" in path  # the runner turns the layers' gate on from it
    runner.native_step.prefill = path.startswith("native")
    # oneDNN: the step's callback for its wide products, the layers' plain copies for theirs;
    # packed: neither, so every product takes the packed weights.
    runner.native_step.bf16_products = path.endswith("onednn")
    for layer, weight in plain.items():
        layer.weight_bf16 = weight if path.endswith("onednn") else None


def prefill_rate(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return sum(len(p) for p in prompts) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="name, folder or hub id")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[170, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if not bf16_units():
        print("this CPU has no bf16 units (amx_bf16, avx512_bf16): nothing to compare")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    longest = max(args.prompt_tokens)
    settings = EngineSettings(
        model=str(resolve_model(args.model)),
        prefill_dtype="bfloat16",
        max_batch_size=NUM_PROMPTS,
        max_model_len=max(2048, longest + 16),
        enable_prefix_caching=False,
        quantization=args.quantization,
    )
    engine = LLMEngine.load(settings)
    runner = engine.runner
    if not (isinstance(runner, ModelRunner) and runner.native_step and runner.bf16_gate):
        print("the model's layers are not native (see the engine's log): nothing to compare")
        return 2
    if args.quantization == "none":
        weights = both_routes(engine)
        paths = [p for p in PATHS if "packed" not in p or runner.native_step.kernels.isa == ISA]
    elif runner.native_step.quantized_bf16:
        weights, paths = {}, list(QUANTIZED_PATHS)
    else:
        print("quantized layers take bf16 rows only where the kernels run AVX512_BF16")
        return 2
    rng = random.Random(0)
    load = os.getloadavg()
    results: dict[int, dict[str, float]] = {}
    for length in args.prompt_tokens:
        rates: dict[str, list[float]] = {path: [] for path in paths}
        for round_ in range(args.rounds):
            order = paths[round_ % len(paths) :] + paths[: round_ % len(paths)]
            for path in order:
                set_path(engine, path, weights)
                vocab = runner.shape.vocab_size
                prompts = [
                    [rng.randrange(100, vocab) for _ in range(length)] for _ in range(NUM_PROMPTS)
                ]
                rates[path].append(prefill_rate(engine, prompts, f"{length}-{round_}-{path}"))
        results[length] = {path: statistics.median(r) for path, r in rates.items()}
        native = results[length]["native fp32"]
        figures = [f"{p} {v:.0f} tok/s ({v / native:.2f}x)" for p, v in results[length].items()]
        print(f"{length:5d}-token prompts: " + ", ".join(figures))
    print(f"load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"units": bf16_units(), "prompt_tokens_per_s": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
