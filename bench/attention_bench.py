"""Prefill attention per unit: one chunk of a model's heads through the native kernels, fp32
blocks, bf16 blocks on VDPBF16PS and bf16 on AMX tiles (where this CPU has each), interleaved
rounds, the median of each.

    .venv/bin/python bench/attention_bench.py                 # SmolLM2's heads, a 1,024-row chunk
    .venv/bin/python bench/attention_bench.py --rows 512 --start 1500

Prints ms per chunk and GFLOPS (causal multiply-adds x 2) and writes results/attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.lib.machine import cpu_info, load_average, read_cpuinfo
from bench.lib.output import line_buffered_stdout
from slotserve.engine.core.kernels import NativeKernels, load_kernels
from slotserve.settings import CommonSettings


def units(kernels: NativeKernels) -> list[str]:
    """The units this CPU runs: fp32 always, bf16 with AVX512_BF16, amx where the tiles run."""
    out = ["fp32"]
    if "avx512_bf16" in kernels.supported_isas:
        out.append("vdpbf16ps")
        if kernels.set_amx(True):
            out.append("amx")
    return out


def main() -> None:
    line_buffered_stdout()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024, help="the chunk's rows")
    parser.add_argument("--start", type=int, default=0, help="positions already cached")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per kv head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="calls timed per round")
    parser.add_argument("--out", type=Path, default=Path("results/attention.json"))
    args = parser.parse_args()

    kernels = load_kernels(CommonSettings().home)
    kv, group, d, rows, start = args.kv_heads, args.group, args.head_dim, args.rows, args.start
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, kv, start + rows, d, generator=generator)
    values = torch.randn(1, kv, start + rows, d, generator=generator)
    queries = torch.randn(rows, kv, group, d, generator=generator)
    slots = torch.zeros(rows, dtype=torch.int64)
    lens = torch.arange(start + 1, start + rows + 1, dtype=torch.int64)
    flops = 4 * kv * group * d * int(lens.sum())
    scale = d**-0.5

    def call(unit: str) -> None:
        kernels.set_amx(unit == "amx")
        kernels.slot_attention(queries, keys, values, slots, lens, scale, bf16=unit != "fp32")

    names = units(kernels)
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for name in names:
            call(name)  # the workspace grows once
        for _ in range(args.rounds):
            for name in names:
                call(name)
                began = time.perf_counter()
                for _ in range(args.calls):
                    call(name)
                times[name].append((time.perf_counter() - began) / args.calls)
    finally:
        kernels.set_amx(True)
    results = {}
    for name in names:
        seconds = statistics.median(times[name])
        results[name] = {"ms": seconds * 1000, "gflops": flops / seconds / 1e9}
        print(f"{name:10s} {seconds * 1000:8.2f} ms  {flops / seconds / 1e9:7.0f} GFLOPS")
    report = {
        "shape": {"rows": rows, "start": start, "kv_heads": kv, "group": group, "head_dim": d},
        "threads": torch.get_num_threads(),
        "isa": kernels.isa,
        "cpu": cpu_info(read_cpuinfo()),
        "load_average": load_average(),
        "units": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
