"""What the machine is, for a benchmark's report: the CPU's model and the instruction-set flags
that decide which kernels the engines can use, and how busy the machine was."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The flags that decide which kernels llama.cpp (built with -march=native), vLLM's CPU build
# and torch can use.
KEY_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text; empty where there is none (not Linux: no flags known)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_info(cpuinfo: str) -> dict[str, Any]:
    """The CPU's model name and which of KEY_FLAGS it has, from /proc/cpuinfo's text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name", "unknown"),
        "cpu_count": os.cpu_count(),
        "flags": [flag for flag in KEY_FLAGS if flag in flags],
    }


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages: on a shared machine, how busy it was."""
    return [round(value, 2) for value in os.getloadavg()]
