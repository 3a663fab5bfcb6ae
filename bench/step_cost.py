"""Decode step cost by batch size, the batch sizes' steps interleaved in one process.

    .venv/bin/python bench/step_cost.py --model smollm2 [--batches 1 4 8 32] [--rounds 64]
        [--isa plain_c|avx2_fma|avx512]

The argument for continuous batching is that a decode step costs about the same for 1 or 4
sequences. Tokens/s measured one batch size after another moves with the machine (a shared
host's memory bandwidth changed by half within minutes here), so this builds one engine per
batch size on one model, brings each to steady decode (128-token prompts), then runs their steps
round-robin and takes each one's median: a slow moment costs every batch size alike.
Prints ms per step and the ratio to batch 1; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from slotserve.engine.core.openmp import openmp_environment

os.environ.update(openmp_environment())  # libgomp reads it when torch loads
from pathlib import Path

from bench.lib.engine import Bench, interleaved_step_ms
from slotserve.engine.core.kernels import ISAS, load_kernels
from slotserve.engine.core.model.loader import load_model, pick_device, pick_dtype
from slotserve.models.resolve import resolve_model
from slotserve.settings import CommonSettings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="name, folder or hub id")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--rounds", type=int, default=64, help="steps per batch size")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--isa",
        choices=ISAS,
        help="run the native kernels with this instruction set (default: the widest this CPU has)",
    )
    args = parser.parse_args()
    kernels = load_kernels(CommonSettings().home)
    isa = kernels.set_isa(args.isa or ISAS[-1])
    print(f"native kernels: {isa} (this CPU: {', '.join(kernels.supported_isas)})")
    device = pick_device("auto")
    model, tokenizer = load_model(resolve_model(args.model), device, pick_dtype("auto", device))
    bench = Bench(model, tokenizer, None, [], device, slots=max(args.batches))
    step_ms = interleaved_step_ms(bench, args.batches, args.rounds)
    first = step_ms.get(1)
    for batch, ms in step_ms.items():
        ratio = f"  {ms / first:.2f}x batch 1" if first else ""
        print(f"  batch {batch:>3}: {ms:6.1f} ms a step{ratio}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        figures = {"model": args.model, "native_kernels_isa": isa, "step_ms": step_ms}
        args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
