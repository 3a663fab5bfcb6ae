"""The engine side of the benchmarks: one model shared by engines of several batch sizes, and
what they measure on it (decode rates, step times) beside Hugging Face's ``generate()``.

The OpenMP environment must be set before torch loads: a script imports this after
``os.environ.update(openmp_environment())``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.model.loader import find_kernels
from slotserve.engine.core.model.prepare import PreparedModel, prepare_model
from slotserve.engine.core.model.runner import ModelRunner
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.settings import EngineSettings
from slotserve.settings import CommonSettings


@dataclass
class Bench:
    """One model for every engine a benchmark builds, and transformers' copy to compare with."""

    # transformers' objects, as the runner takes them (their attributes are not typed here).
    model: Any
    tokenizer: Any
    hf_model: Any  # None when a benchmark runs no HF side
    prompt_ids: list[int]
    device: torch.device
    # Slots of every runner built on ``model``: its linear layers are prepared once, at the
    # first engine, calibrated for this many rows, and every engine (each batch size) runs on
    # them; a real engine sizes them for its max_batch_size. 0: the first engine's batch size.
    slots: int = 0
    # ``model`` prepared for the engines (by the first make_engine).
    prepared: PreparedModel | None = field(default=None, repr=False)

    def prepare(self, max_rows: int) -> PreparedModel:
        """``model``'s layers set up for the engines, once (later calls return the same)."""
        if self.prepared is None:
            param = next(self.model.parameters())
            kernels = find_kernels(param.device, param.dtype, CommonSettings().home)
            self.prepared = prepare_model(self.model, kernels, max_rows=max(self.slots, max_rows))
        return self.prepared


def make_engine(bench: Bench, **settings: Any) -> LLMEngine:
    max_model_len = int(settings.setdefault("max_model_len", 1024))
    # Every request here has the same prompt: with the prefix cache, all but the first would
    # skip their prefill, and the policies and HF would no longer do the same work
    # (bench/prefix_bench.py measures the cache).
    settings.setdefault("enable_prefix_caching", False)
    engine_settings = EngineSettings(model="bench", **settings)
    runner = ModelRunner(
        bench.prepare(engine_settings.max_batch_size),
        num_slots=max(bench.slots, engine_settings.max_batch_size),
        max_model_len=max_model_len,
    )
    return LLMEngine(
        engine_settings,
        runner,
        bench.tokenizer,
        kv_cache_tokens=engine_settings.max_batch_size * max_model_len,
        model_name="bench",
        record_steps=True,
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def hf_generate(
    bench: Bench, batch: int, new_tokens: int, prompt: list[int] | None = None
) -> float:
    """Seconds for one HF generate() of ``batch`` copies of the prompt, ignoring EOS."""
    ids = torch.tensor([prompt or bench.prompt_ids] * batch, device=bench.device)
    start = time.perf_counter()
    with torch.inference_mode():
        bench.hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=bench.tokenizer.pad_token_id or 0,
        )
    return time.perf_counter() - start


def ours_decode(
    bench: Bench, batch: int, new_tokens: int, prompt: list[int]
) -> tuple[float, float]:
    """Aggregate tokens/s of ``batch`` copies of the prompt: decode only, and prefill included."""
    engine = make_engine(bench, max_batch_size=batch, max_batched_tokens=batch * len(prompt))
    for i in range(batch):
        engine.add_request(f"d{i}", prompt, greedy(new_tokens))
    start = time.perf_counter()
    num_tokens = sum(len(out.token_ids) for out in engine.step())  # every prefill, 1st token
    decode_start = time.perf_counter()
    while engine.has_unfinished():
        num_tokens += sum(len(out.token_ids) for out in engine.step())
    end = time.perf_counter()
    return (num_tokens - batch) / (end - decode_start), num_tokens / (end - start)


def hf_decode_rate(bench: Bench, batch: int, new_tokens: int, prompt: list[int]) -> float:
    """HF generate()'s decode tokens/s: a long minus a one-token generate (drops prefill)."""
    first = hf_generate(bench, batch, 1, prompt)
    full = hf_generate(bench, batch, new_tokens, prompt)
    return batch * (new_tokens - 1) / max(1e-9, full - first)


def decode_prompt(length: int = 128) -> list[int]:
    """The decode tests' prompt: fixed random token ids (no prefix for a cache to share)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(100, 40_000, (length,), generator=generator).tolist()


def interleaved_step_ms(bench: Bench, batches: list[int], rounds: int) -> dict[int, float]:
    """Median ms of a decode-only step at each batch size, the sizes' steps interleaved."""
    prompt = decode_prompt()
    engines = {}
    for batch in batches:
        engine = make_engine(bench, max_batch_size=batch, max_batched_tokens=batch * len(prompt))
        for i in range(batch):
            engine.add_request(f"s{i}", prompt, greedy(rounds + 8))
        engine.step()  # every prefill
        engine.step()  # a first decode step (warm caches)
        engines[batch] = engine
    times: dict[int, list[float]] = {batch: [] for batch in batches}
    for _ in range(rounds):
        for batch, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[batch].append(time.perf_counter() - start)
    return {batch: statistics.median(values) * 1e3 for batch, values in times.items()}
