"""``slotserve up``: engines and a gateway on this machine, until Ctrl-C.

slotserve up                      # 2 engines on SmolLM2 behind a gateway on port 8080
slotserve up --engines 1 --policy static --port 9000
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from slotserve.contracts.pool_spec import (
    BATCHING_POLICIES,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS,
    DEFAULT_POLICY,
    AdmissionSpec,
    BatchingSpec,
)
from slotserve.contracts.weights import DTYPES, QUANTIZATIONS
from slotserve.local.processes import ChildExitedError, Supervisor, interrupt_on_signals
from slotserve.local.stack import (
    DEMO_MODEL,
    EngineOptions,
    PoolPlan,
    RunningStack,
    assign_ports,
    default_num_threads,
    describe_redis,
    free_port,
    plan_redis,
    port_is_free,
    print_children,
    resolve_model_once,
    start_stack,
)
from slotserve.models.resolve import default_served_name
from slotserve.settings import CommonSettings

DEFAULT_GATEWAY_PORT = 8080


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotserve up",
        description="Run engines and a gateway on this machine until Ctrl-C.",
    )
    parser.add_argument("--model", default=DEMO_MODEL, help="name, local HF folder or hub id")
    parser.add_argument("--served-model-name", help="name clients send (default: from --model)")
    parser.add_argument("--engines", type=int, default=2, help="number of engine processes")
    parser.add_argument("--host", default="127.0.0.1", help="address everything listens on")
    parser.add_argument(
        "--port", type=int, help=f"gateway port (default {DEFAULT_GATEWAY_PORT}, or a free one)"
    )
    parser.add_argument("--engine-ports", help="comma-separated engine ports (default: free ports)")
    parser.add_argument("--policy", choices=BATCHING_POLICIES, default=DEFAULT_POLICY)
    # The pool defaults of slotserve.contracts (DESIGN.md's InferencePool), as on Kubernetes.
    parser.add_argument(
        "--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE, help="slots per engine"
    )
    parser.add_argument(
        "--max-queue-delay-microseconds", type=int, default=DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--kv-cache-tokens", type=int, help="KV cache per engine (default: slots x max-model-len)"
    )
    parser.add_argument("--num-threads", type=int, help="torch threads per engine")
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS, help="weight-only int8/int4 (CPU engines)"
    )
    parser.add_argument("--max-queue-size", type=int, default=256, help="gateway queue limit")
    parser.add_argument("--queue-timeout-seconds", type=float, default=30)
    parser.add_argument("--redis-url", help="use this Redis (default: start redis-server if found)")
    parser.add_argument(
        "--no-redis", action="store_true", help="use the gateway's in-process admission"
    )
    parser.add_argument("--log-dir", type=Path, help="where child logs go (default: a run folder)")
    parser.add_argument("--ready-timeout-seconds", type=float, default=300)
    return parser


def default_run_dir(kind: str) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return CommonSettings().home / "runs" / f"{kind}-{stamp}"


def parse_ports(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise SystemExit(f"slotserve up: --engine-ports must be numbers: {exc}") from None


def plan_pool(args: argparse.Namespace, model_source: str) -> PoolPlan:
    batching = BatchingSpec(
        policy=args.policy,
        max_batch_size=args.max_batch_size,
        max_queue_delay_microseconds=args.max_queue_delay_microseconds,
    )
    engine = EngineOptions(
        model=model_source,
        served_model_name=args.served_model_name or default_served_name(args.model),
        batching=batching,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens or args.max_batch_size * args.max_model_len,
        num_threads=args.num_threads or default_num_threads(args.engines),
        dtype=args.dtype,
        quantization=args.quantization,
    )
    admission = AdmissionSpec(
        max_queue_size=args.max_queue_size, queue_timeout_seconds=args.queue_timeout_seconds
    )
    return PoolPlan(engine=engine, num_engines=args.engines, admission=admission)


def usage_examples(gateway_url: str, model: str) -> str:
    """Copy-pasteable curl and Python openai examples for the running gateway."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
    }
    curl = (
        f"curl -s {gateway_url}/v1/chat/completions \\\n"
        f"  -H 'Content-Type: application/json' \\\n"
        f"  -d {shlex.quote(json.dumps(body))}"
    )
    python = (
        "python - <<'EOF'\n"
        "from openai import OpenAI\n"
        f'client = OpenAI(base_url="{gateway_url}/v1", api_key="unused")\n'
        "answer = client.chat.completions.create(\n"
        f'    model="{model}",\n'
        '    messages=[{"role": "user", "content": "What is the capital of France?"}],\n'
        "    max_tokens=32,\n"
        ")\n"
        "print(answer.choices[0].message.content)\n"
        "EOF"
    )
    return f"{curl}\n\n{python}"


def print_banner(console: Console, stack: RunningStack) -> None:
    pool = stack.pools[0]
    console.print()
    console.print(
        f"[bold green]slotserve is up[/]: gateway [bold]{stack.gateway_url}[/] serving model "
        f"[bold]{pool.model}[/] on {pool.num_engines} engine(s) "
        f"({pool.engine.batching.policy} batching, {pool.engine.batching.max_batch_size} slots "
        f"each), {describe_redis(stack.redis)}"
    )
    print_children(console, stack.children)
    console.print("\nTry it from another terminal (curl, then Python with openai):", style="bold")
    console.print(usage_examples(stack.gateway_url, pool.model), highlight=False, markup=False)
    console.print("\nPress Ctrl-C to stop.", style="bold")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.engines < 1:
        raise SystemExit("slotserve up: --engines must be at least 1")
    # soft_wrap: the examples must stay copy-pasteable even when stdout is not a terminal.
    console = Console(highlight=False, soft_wrap=True)
    port = args.port
    if port is None:
        default_free = port_is_free(DEFAULT_GATEWAY_PORT, args.host)
        port = DEFAULT_GATEWAY_PORT if default_free else free_port()
    run_dir = args.log_dir or default_run_dir("up")
    with interrupt_on_signals():
        try:
            with Supervisor(run_dir, console=console) as supervisor:
                console.print(f"Resolving model [bold]{args.model}[/] ...")
                pool = plan_pool(args, resolve_model_once(args.model))
                assign_ports([pool], parse_ports(args.engine_ports))
                redis = plan_redis(args.redis_url, use_redis=not args.no_redis)
                stack = start_stack(
                    supervisor,
                    [pool],
                    host=args.host,
                    gateway_port=port,
                    redis=redis,
                    run_dir=run_dir,
                    ready_timeout_seconds=args.ready_timeout_seconds,
                )
                print_banner(console, stack)
                while True:
                    supervisor.check_alive()
                    time.sleep(0.5)
        except KeyboardInterrupt:
            console.print("\nStopped: every engine, the gateway and Redis have exited.")
            return 0
        except (ChildExitedError, TimeoutError) as exc:
            console.print(f"[red]slotserve up failed:[/] {exc}", markup=True, highlight=False)
            return 1
