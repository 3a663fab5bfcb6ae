"""The measuring half of bench/llamacpp_peer.py; it runs on the python of llama-cpp-python's venv.

Imports only llama_cpp and the standard library (slotserve is not installed there). Prints one
JSON object on stdout; llama.cpp's own log goes to stderr. With --serve it runs llama-cpp-python's
OpenAI server instead (the arguments after --serve are the server's).
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import llama_cpp  # type: ignore[import-not-found]
import llama_cpp.llama_cpp as low_level  # type: ignore[import-not-found]

# The same text and prompt shapes as bench/engine_http_bench.py, so the workloads match.
TEXT = (
    "The history of the city begins with a small settlement by the river, where traders met "
    "to exchange grain, salt and cloth. Over the centuries it grew into a market town, then a "
    "port, and finally the capital of a province. "
)


def make_prompts(tokens: list[int], num: int, num_tokens: int) -> list[list[int]]:
    # Each prompt differs in its first token so no two are identical (and no prefix is shared).
    return [[tokens[i % 50], *tokens[1:num_tokens]] for i in range(num)]


def generate_rate(llm: Any, prompt: list[int], new_tokens: int) -> float:
    """Batch 1 through the high-level API: decode tokens/s, prefill and first token excluded."""
    stamps: list[float] = []
    # generate() never stops at EOS by itself, like ignore_eos; temp 0 is greedy.
    for _ in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == new_tokens:
            break
    return (new_tokens - 1) / (stamps[-1] - stamps[0])


def batched_rate(model: Any, prompts: list[list[int]], new_tokens: int, threads: int) -> float:
    """Aggregate decode tokens/s of len(prompts) sequences decoded together, one llama_decode
    per step (as llama.cpp's `batched` example does); each prompt is prefilled on its own."""
    num = len(prompts)
    per_seq = -(-(len(prompts[0]) + new_tokens) // 256) * 256
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = num * per_seq
    params.n_batch = max(len(prompts[0]), num)
    params.n_ubatch = params.n_batch
    params.n_seq_max = num
    # A KV buffer per sequence: the header advises it when sequences share no long prefix.
    params.kv_unified = False
    params.n_threads = threads
    params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama_init_from_model failed for {num} sequences")
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
    sampler = llama_cpp.llama_sampler_init_greedy()

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, wants_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wants_logits
        if (rc := llama_cpp.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    try:
        last: list[int] = []
        for seq, prompt in enumerate(prompts):
            decode([(t, pos, seq, pos == len(prompt) - 1) for pos, t in enumerate(prompt)])
            last.append(llama_cpp.llama_sampler_sample(sampler, ctx, -1))
        started = time.perf_counter()
        for step in range(new_tokens - 1):
            decode([(last[s], len(prompts[s]) + step, s, True) for s in range(num)])
            # Outputs come in batch order, so output s belongs to sequence s; EOS is ignored.
            last = [llama_cpp.llama_sampler_sample(sampler, ctx, s) for s in range(num)]
        return num * (new_tokens - 1) / (time.perf_counter() - started)
    finally:
        llama_cpp.llama_sampler_free(sampler)
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def disable_extra_buffers() -> None:
    """Load weights without llama.cpp's extra buffer types (repacked or AMX layouts).

    On a Xeon with AMX, the AMX matrix product of llama.cpp in 0.3.36 crashed (SIGSEGV in
    ggml_backend_amx_mul_mat) on the first decode of this Q4_1 model. Neither Llama nor the
    server exposes the model parameter, so their shared source of defaults is wrapped. For Q4_1
    nothing else changes: llama.cpp repacks only other types (Q4_0, Q4_K, IQ4_NL, Q8_0).
    """
    default = low_level.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = default()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = without_extra_buffers


def median_of(repeats: int, measure: Callable[[], float]) -> tuple[float, list[float]]:
    runs = [measure() for _ in range(repeats)]
    return statistics.median(runs), runs


def main() -> int:
    if "--serve" in sys.argv:
        at = sys.argv.index("--serve")
        if "--no-extra-buffers" in sys.argv[:at]:
            disable_extra_buffers()
        sys.argv = ["llama_cpp.server", *sys.argv[at + 1 :]]
        runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server-prompts", type=int, default=0, help="prompt texts to return")
    parser.add_argument("--no-extra-buffers", action="store_true")
    args = parser.parse_args()
    if args.no_extra_buffers:
        disable_extra_buffers()

    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=args.prompt_tokens + args.new_tokens + 64,
        n_batch=args.prompt_tokens,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    text = TEXT * (args.prompt_tokens // 20 + 2)
    tokens = llm.tokenize(text.encode(), add_bos=False)
    longest = max([1, *args.batches, args.server_prompts])
    prompts = make_prompts(tokens, longest, args.prompt_tokens)
    rates: dict[str, float] = {}
    runs: dict[str, list[float]] = {}
    rates["batch_1"], runs["batch_1"] = median_of(
        args.repeats, lambda: generate_rate(llm, prompts[0], args.new_tokens)
    )
    rates["batch_1_batch_api"], runs["batch_1_batch_api"] = median_of(
        args.repeats, lambda: batched_rate(llm.model, prompts[:1], args.new_tokens, args.threads)
    )
    for num in args.batches:
        rates[f"batch_{num}"], runs[f"batch_{num}"] = median_of(
            args.repeats,
            partial(batched_rate, llm.model, prompts[:num], args.new_tokens, args.threads),
        )
    result = {
        "tokens_per_s": rates,
        "runs_tokens_per_s": runs,
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "server_prompts": [
            llm.detokenize(p).decode("utf-8", errors="replace")
            for p in prompts[: args.server_prompts]
        ],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
