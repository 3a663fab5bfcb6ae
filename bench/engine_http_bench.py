"""What the HTTP layer costs: tokens/s through `slotserve engine` versus the in-process AsyncEngine.

The same workload (C clients, each sending R requests one after another: a P-token prompt, N new
tokens, greedy, ignore_eos) runs against an AsyncEngine in this process and against a real
`slotserve engine` subprocess over HTTP (streamed SSE, like an OpenAI client). Both use the same
settings; runs alternate so machine noise hits both alike. Prints a table, writes JSON.

    .venv/bin/python bench/engine_http_bench.py                 # SmolLM2, concurrency 16 and 8
    .venv/bin/python bench/engine_http_bench.py --model /path/to/tiny --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from slotserve.engine.core.async_engine import AsyncEngine
from slotserve.engine.core.openmp import apply_openmp_environment
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.settings import EngineSettings
from slotserve.local.stack import free_port
from slotserve.models.resolve import resolve_model

LLAMA_CPP_SERVER_C8 = 33.5  # tok/s aggregate, llama-cpp-python's server, 8 clients (FACTS.md)
TEXT = (
    "The history of the city begins with a small settlement by the river, where traders met "
    "to exchange grain, salt and cloth. Over the centuries it grew into a market town, then a "
    "port, and finally the capital of a province. "
)


@dataclass
class Run:
    mode: str  # "in-process" | "http"
    concurrency: int
    num_requests: int
    generated_tokens: int
    wall_s: float
    ttft_median_s: float
    # CPU seconds of the serving process during the run: all threads, and the event-loop thread
    # alone (HTTP parsing, SSE writes, handing outputs over). Unlike tokens/s on a shared
    # machine, their ratio does not depend on what else runs.
    server_cpu_s: float = 0.0
    event_loop_cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s


def make_prompts(tokenizer, num: int, num_tokens: int) -> list[list[int]]:
    ids = tokenizer(TEXT * (num_tokens // 20 + 2)).input_ids
    # Each prompt differs in its first token so no two are identical.
    return [[ids[i % 50], *ids[1:num_tokens]] for i in range(num)]


async def run_workload(submit, prompts: list[list[int]], concurrency: int, mode: str) -> Run:
    """``submit(prompt) -> (num_generated, ttft)``; C workers share the prompt list."""
    queue = list(prompts)
    ttfts: list[float] = []
    generated = 0

    async def worker() -> None:
        nonlocal generated
        while queue:
            num, ttft = await submit(queue.pop())
            generated += num
            ttfts.append(ttft)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return Run(mode, concurrency, len(prompts), generated, wall, statistics.median(ttfts))


def in_process_submit(engine: AsyncEngine, max_tokens: int):
    counter = iter(range(10**9))

    async def submit(prompt: list[int]) -> tuple[int, float]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        ttft = 0.0
        num = 0
        async for out in engine.add_request(f"bench-{next(counter)}", prompt, params):
            if not ttft and out.num_generated_tokens:
                ttft = time.perf_counter() - start
            num = out.num_generated_tokens
        return num, ttft

    return submit


def http_submit(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int):
    async def submit(prompt: list[int]) -> tuple[int, float]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        ttft = 0.0
        num = 0
        async with session.post(url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                if not ttft:
                    ttft = time.perf_counter() - start
                event = json.loads(line[6:])
                if event.get("usage"):
                    num = event["usage"]["completion_tokens"]
        return num, ttft

    return submit


def llama_cpp_reference(path: str | None) -> tuple[float, str]:
    """llama-cpp-python's server at concurrency 8, in tok/s, and where the figure comes from:
    measured by bench/llamacpp_peer.py --server when its JSON is given, else FACTS.md's."""
    if path is None:
        return LLAMA_CPP_SERVER_C8, "FACTS.md"
    value = json.loads(Path(path).read_text()).get("server_c8_tokens_per_s")
    if not isinstance(value, int | float):
        sys.exit(f"{path} holds no server_c8_tokens_per_s: run llamacpp_peer.py with --server")
    return float(value), path


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(whole process, main thread) CPU seconds from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")

    def read(path: str) -> float:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")


def start_server(args, model_path: str, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    slotserve = Path(sys.executable).with_name("slotserve")
    argv = [
        str(slotserve), "engine", "--model", model_path, "--served-model-name", "bench",
        "--host", "127.0.0.1", "--port", str(port), "--max-batch-size", str(args.max_batch_size),
        "--num-threads", str(args.num_threads), "--max-model-len", str(args.max_model_len),
        "--log-level", "WARNING",
    ]  # fmt: skip
    log = log_path.open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited {proc.returncode}: see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"engine not ready in 300 s: see {log_path}")


async def main_async(args) -> dict:
    console = Console(width=140)
    model_path = resolve_model(args.model)
    settings = EngineSettings(
        model=model_path,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
    )
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    console.print(f"starting `slotserve engine` on port {port} and loading {model_path} here")
    server = start_server(args, model_path, port, out_path.with_suffix(".engine.log"))
    engine = await asyncio.to_thread(AsyncEngine.load, settings)
    await engine.start()
    prompts_all = make_prompts(engine.tokenizer, max(args.concurrency) * args.requests_per_client,
                               args.prompt_tokens)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    runs: list[Run] = []
    try:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            # Warm both paths (first-call allocations, thread pools) outside the measurement.
            await run_workload(in_process_submit(engine, 4), prompts_all[:2], 2, "warm")
            await run_workload(http_submit(session, url, "bench", 4), prompts_all[:2], 2, "warm")
            for concurrency in args.concurrency:
                prompts = prompts_all[: concurrency * args.requests_per_client]
                for repeat in range(args.repeats):
                    # ABBA order, so a load change on the machine hits both modes alike.
                    modes = ("in-process", "http") if repeat % 2 == 0 else ("http", "in-process")
                    for mode in modes:
                        submit = (
                            in_process_submit(engine, args.max_tokens)
                            if mode == "in-process"
                            else http_submit(session, url, "bench", args.max_tokens)
                        )
                        # In process, the "server" is this process; over HTTP, the subprocess.
                        pid = os.getpid() if mode == "in-process" else server.pid
                        cpu_before = cpu_seconds(pid)
                        run = await run_workload(submit, prompts, concurrency, mode)
                        cpu_after = cpu_seconds(pid)
                        run.server_cpu_s = cpu_after[0] - cpu_before[0]
                        run.event_loop_cpu_s = cpu_after[1] - cpu_before[1]
                        console.print(
                            f"  c={concurrency:<3} {mode:<11} {run.tokens_per_s:7.1f} tok/s "
                            f"({run.generated_tokens} tokens in {run.wall_s:.1f} s; event loop "
                            f"{run.event_loop_cpu_s:.1f} of {run.server_cpu_s:.1f} CPU s)"
                        )
                        runs.append(run)
    finally:
        await engine.shutdown()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return report(args, console, runs, model_path)


def report(args, console: Console, runs: list[Run], model_path: str) -> dict:
    table = Table(title="engine throughput: in-process AsyncEngine vs HTTP (SSE)")
    columns = (
        "concurrency", "in-process tok/s", "http tok/s", "http vs in-process",
        "http CPU vs in-process", "http event-loop CPU", "http TTFT p50",
    )  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    summary = []
    for concurrency in args.concurrency:

        def median(mode: str, attr: str, c: int = concurrency) -> float:
            return statistics.median(
                getattr(r, attr) for r in runs if r.mode == mode and r.concurrency == c
            )

        local, http = median("in-process", "tokens_per_s"), median("http", "tokens_per_s")
        overhead = 1 - http / local
        loop_share = median("http", "event_loop_cpu_s") / median("http", "server_cpu_s")
        # CPU seconds for the same work barely move with machine load, unlike wall time.
        cpu_overhead = median("http", "server_cpu_s") / median("in-process", "server_cpu_s") - 1
        summary.append(
            {
                "concurrency": concurrency,
                "in_process_tokens_per_s": local,
                "http_tokens_per_s": http,
                "http_overhead": overhead,
                "http_event_loop_cpu_share": loop_share,
                "http_cpu_overhead": cpu_overhead,
                "http_event_loop_cpu_ms_per_token": 1000
                * median("http", "event_loop_cpu_s")
                / median("http", "generated_tokens"),
                "http_ttft_median_s": median("http", "ttft_median_s"),
                "in_process_ttft_median_s": median("in-process", "ttft_median_s"),
            }
        )
        table.add_row(
            str(concurrency), f"{local:.1f}", f"{http:.1f}", f"{-overhead:+.1%}",
            f"{cpu_overhead:+.1%}", f"{loop_share:.1%}", f"{median('http', 'ttft_median_s'):.2f} s",
        )  # fmt: skip
    console.print(table)
    console.print(
        "http CPU vs in-process = CPU seconds of the serving process for the same work (the "
        "in-process figure includes the client)."
    )
    console.print(
        "http event-loop CPU = the share of the serving process's CPU time spent on its "
        "event-loop thread (HTTP, JSON, SSE); the model runs on other threads."
    )
    c8 = next((s for s in summary if s["concurrency"] == 8), None)
    reference, source = llama_cpp_reference(getattr(args, "llama_cpp_json", None))
    if c8:
        console.print(
            f"concurrency 8 over HTTP: {c8['http_tokens_per_s']:.1f} tok/s = "
            f"{c8['http_tokens_per_s'] / reference:.1f}x llama-cpp-python's server "
            f"({reference:.1f} tok/s, {source})"
        )
    result = {
        "model": model_path,
        "settings": {
            "max_batch_size": args.max_batch_size,
            "num_threads": args.num_threads,
            "max_model_len": args.max_model_len,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "requests_per_client": args.requests_per_client,
            "repeats": args.repeats,
        },
        "cpu_count": os.cpu_count(),
        "summary": summary,
        "runs": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in runs],
        "reference_llama_cpp_python_server_c8_tokens_per_s": reference,
        "reference_source": source,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="name, folder or hub id")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 8])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=256, help="prompt + new tokens")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="results/engine_http_bench.json")
    parser.add_argument("--from-json", help="re-print the table of an earlier run's JSON")
    parser.add_argument(
        "--llama-cpp-json",
        help="compare with the server figure measured by bench/llamacpp_peer.py --server "
        "(its JSON) instead of FACTS.md's",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        fields = set(Run.__dataclass_fields__)
        runs = [Run(**{k: v for k, v in r.items() if k in fields}) for r in saved["runs"]]
        for key, value in saved["settings"].items():
            setattr(args, key, value)
        args.concurrency = sorted({r.concurrency for r in runs}, reverse=True)
        report(args, Console(width=140), runs, saved["model"])
        return 0
    apply_openmp_environment()  # as `slotserve engine` does, before this process loads torch
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
