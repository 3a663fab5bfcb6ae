"""What penalties, logit_bias and logprobs cost per engine step, at batch 8 and 32.

    .venv/bin/python bench/sampling_bench.py --out results/sampling [--steps 24] [--repeats 3]

Three measurements, side by side in one process (ratios carry over between machines, absolute
figures do not): the sampler alone on random ``[batch, vocab]`` logits (SmolLM2's 49,152 tokens,
each sequence with 128 prompt and 64 generated tokens; random logits are flat, the worst case for
top_p), whole decode steps of the real engine on SmolLM2 with every sequence using the
parameters, and the sampler's part of those steps (the overhead column: extra sampler time over a
plain greedy step's, as a share of the plain step). Configurations alternate within each repeat;
medians are reported. Prints a table and writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from slotserve.engine.core.openmp import openmp_environment

os.environ.update(openmp_environment())  # libgomp reads it when torch loads

import torch

from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.model.sampling import Sampler
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.protocols import Tokenizer
from slotserve.engine.core.sequence import Sequence
from slotserve.engine.core.structured import Grammars, json_schema_grammar
from slotserve.engine.settings import EngineSettings

VOCAB = 49_152
PROMPT_LEN = 128
CONFIGS: dict[str, dict[str, object]] = {
    "plain greedy": {"temperature": 0.0},
    "plain sampled (top_p 0.9)": {"temperature": 0.7, "top_p": 0.9, "seed": 1},
    "penalties, greedy": {
        "temperature": 0.0,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
    },
    "penalties + logit_bias + min_tokens, sampled": {
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {i * 97: 1.5 for i in range(20)},
        "min_tokens": 1000,
    },
    "logprobs (top 5), greedy": {"temperature": 0.0, "logprobs": 5},
    "json_schema grammar, greedy": {"temperature": 0.0, "grammar_schema": "ITEMS"},
}
# A schema that keeps a model busy for many tokens (a list of records).
ITEMS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["name", "count"],
    },
}


def params_for(name: str, max_tokens: int) -> SamplingParams:
    extra = dict(CONFIGS[name])
    if extra.pop("grammar_schema", None):
        extra["grammar"] = json_schema_grammar(ITEMS_SCHEMA)
    extra.setdefault("min_tokens", 0)
    extra["min_tokens"] = min(int(extra["min_tokens"]), max_tokens)  # type: ignore[call-overload]
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)  # type: ignore[arg-type]


def sampler_ms(batch: int, name: str, steps: int) -> float:
    """Median milliseconds of Sampler.sample over ``steps`` consecutive decode steps (NaN for a
    grammar: random logits and tokens would leave it at once)."""
    if "grammar_schema" in CONFIGS[name]:
        return float("nan")
    generator = torch.Generator().manual_seed(0)
    sampler = Sampler(batch, VOCAB, torch.device("cpu"), frozenset({2}))
    params = params_for(name, 4096)
    seqs = []
    for slot in range(batch):
        prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=generator).tolist()
        seq = Sequence(f"s{slot}", prompt, params, arrival_time=0.0)
        seq.token_ids.extend(torch.randint(0, VOCAB, (64,), generator=generator).tolist())
        seq.slot = slot
        seqs.append(seq)
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, VOCAB, generator=generator) * 5
        started = time.perf_counter()
        result = sampler.sample(logits, seqs)
        times.append(time.perf_counter() - started)
        for seq, token in zip(seqs, result.tokens, strict=True):
            seq.token_ids.append(token)  # type: ignore[arg-type]
    return 1000 * statistics.median(times[2:])  # the first steps build the count rows


def engine_step_ms(engine: LLMEngine, batch: int, name: str, steps: int) -> tuple[float, float]:
    """Median milliseconds of a decode step of ``batch`` sequences using ``name``'s params, and
    of the sampler's part of it (timed inside the step, on the model's real logits: on a
    shared machine whole steps vary more than the sampler costs)."""
    sampler = engine.runner.sampler  # type: ignore[attr-defined]  # ModelRunner's, not the protocol's
    sample = sampler.sample
    sampler_times: list[float] = []

    def timed(*args: object) -> object:
        started = time.perf_counter()
        result = sample(*args)
        sampler_times.append(time.perf_counter() - started)
        return result

    sampler.sample = timed
    generator = torch.Generator().manual_seed(1)
    params = params_for(name, steps + 4)
    for i in range(batch):
        prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=generator).tolist()
        engine.add_request(f"{name}-{i}-{time.monotonic_ns()}", prompt, params)
    while engine.stats().num_waiting or any(
        seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running
    ):
        engine.step()  # prefill, not measured
    times = []
    sampler_times.clear()
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    del sampler.sample  # back to the class's method
    return 1000 * statistics.median(times[1:-1]), 1000 * statistics.median(sampler_times[1:-1])


def grammar_compile_ms(tokenizer: Tokenizer) -> dict[str, float]:
    """What a structured request costs before it runs: the one-off tokenizer view, checking a
    new schema, a matcher per sequence."""
    grammars = Grammars(tokenizer)
    started = time.perf_counter()
    grammars.tokenizer  # noqa: B018 - built on first use
    built = time.perf_counter()
    grammar = json_schema_grammar(ITEMS_SCHEMA)
    grammars.check(grammar)
    checked = time.perf_counter()
    for _ in range(10):
        grammars.matcher(grammar)
    matched = time.perf_counter()
    return {
        "tokenizer view (once per engine)": 1000 * (built - started),
        "check a new JSON schema": 1000 * (checked - built),
        "matcher per sequence": 100 * (matched - checked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", type=Path, default=Path("results/sampling"))
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-engine", action="store_true", help="the sampler alone")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = None
    if not args.skip_engine:
        settings = EngineSettings(
            model=args.model, max_batch_size=max(args.batches), max_model_len=512
        )
        engine = LLMEngine.load(settings)
    compile_ms = grammar_compile_ms(engine.tokenizer) if engine is not None else {}
    sampler: dict[str, dict[str, list[float]]] = {}
    steps: dict[str, dict[str, list[float]]] = {}
    in_step: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.repeats):
        for batch in args.batches:
            for name in CONFIGS:  # alternated within a repeat: load drifts hit all alike
                key = str(batch)
                sampler.setdefault(key, {}).setdefault(name, []).append(
                    sampler_ms(batch, name, args.steps)
                )
                if engine is not None:
                    step_ms, sampler_part_ms = engine_step_ms(engine, batch, name, args.steps)
                    steps.setdefault(key, {}).setdefault(name, []).append(step_ms)
                    in_step.setdefault(key, {}).setdefault(name, []).append(sampler_part_ms)
    rows = []
    print(
        f"{'batch':>5}  {'configuration':<46} {'alone ms':>8} {'in step':>8} {'step ms':>8}"
        f" {'+sampler vs plain step':>22}"
    )
    for batch in args.batches:
        key = str(batch)
        plain_step = statistics.median(steps[key]["plain greedy"]) if engine else None
        plain_part = statistics.median(in_step[key]["plain greedy"]) if engine else None
        for name in CONFIGS:
            sampler_median = statistics.median(sampler[key][name])
            step_median = statistics.median(steps[key][name]) if engine else None
            part = statistics.median(in_step[key][name]) if engine else None
            # The extra sampler time over a plain greedy step's sampler, as a share of that step.
            overhead = (
                100 * (part - plain_part) / plain_step
                if part is not None and plain_part is not None and plain_step
                else None
            )
            rows.append(
                {
                    "batch": batch,
                    "configuration": name,
                    "sampler_ms": sampler_median,
                    "step_ms": step_median,
                    "sampler_in_step_ms": part,
                    "sampler_overhead_percent_of_plain_step": overhead,
                }
            )
            step_text = f"{step_median:8.1f}" if step_median is not None else f"{'-':>8}"
            part_text = f"{part:8.2f}" if part is not None else f"{'-':>8}"
            over_text = f"{overhead:+21.1f}%" if overhead is not None else f"{'-':>22}"
            print(
                f"{batch:>5}  {name:<46} {sampler_median:8.2f} {part_text} {step_text} {over_text}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "repeats": args.repeats,
        "configurations": CONFIGS,
        "rows": rows,
        "grammar_compile_ms": compile_ms,
        "raw": {"sampler_ms": sampler, "step_ms": steps, "sampler_in_step_ms": in_step},
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    for what, ms in compile_ms.items():
        print(f"grammar: {what}: {ms:.2f} ms")
    print(f"wrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
