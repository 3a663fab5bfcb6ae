"""With the prefix cache on, greedy outputs are those of the cache off, token for token.

On a tiny random Llama whose greedy choices depend on the whole context (a reused row holding a
wrong key or value, or a stale position leaking past the mask, changes the tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.stats import EngineStats
from slotserve.engine.http.metrics import EngineStatsCollector
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    make_engine,
    model_runner,
    run_staggered,
)

POISON = 4321  # made NaN in the embedding in one test; no other prompt holds it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def tokens(num: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5000, 49_000, (num,), generator=generator).tolist()


def shared_prefix_prompts() -> list[list[int]]:
    """Prompts that share prefixes in every way a row can be reused."""
    system, other, big = tokens(80, 1), tokens(40, 2), tokens(300, 4)
    long = [*system, *tokens(120, 3)]
    return [
        [*system, *tokens(5, 10)],
        long,  # a long row ...
        [*system, *tokens(9, 11)],
        long[:130],  # ... of which a shorter prompt is a prefix: its stale tail is masked
        [*system, *tokens(3, 12)],
        [*system[:50], *tokens(7, 13)],  # diverges inside the system prompt
        list(system),  # all of it cached: the last token is recomputed
        [*other, *tokens(6, 14)],
        [*other, *tokens(6, 15)],
        [*system, *tokens(30, 16)],
        tokens(25, 17),
        [*system, *tokens(5, 10)],  # the first prompt again
        [*big, *tokens(4, 18)],  # a long shared prefix arriving together: the second waits
        [*big, *tokens(6, 19)],  # for the first one's row, then copies it
    ]


def run(model_dir: Path, enable: bool, **settings: Any) -> tuple[list[list[int]], EngineStats]:
    engine = make_engine(model_dir, enable_prefix_caching=enable, **settings)
    seqs = run_staggered(engine, shared_prefix_prompts(), greedy(), every=3, per=2)
    return [s.generated_token_ids for s in seqs], engine.stats()


@pytest.mark.parametrize(
    "settings",
    [
        {"max_batch_size": 3},
        # Chunked prefill from a reused prefix, and preemptions that resume from their rows.
        {"max_batch_size": 4, "max_batched_tokens": 24, "kv_cache_tokens": 400},
        {"max_batch_size": 3, "linear_backend": "onednn"},
        # Batches admitted whole: rows copied from sequences admitted in the same step.
        {"max_batch_size": 3, "policy": "static", "max_batched_tokens": 64},
    ],
    ids=["plain", "chunked-preempted", "onednn", "static"],
)
def test_greedy_outputs_are_identical_with_and_without_the_cache(model_dir, settings):
    without, stats_off = run(model_dir, False, **settings)
    with_cache, stats_on = run(model_dir, True, **settings)
    assert with_cache == without
    assert all(len(out) == 16 for out in with_cache)
    assert stats_off.prefix_cache_hits_total == 0
    # Most of the shared prefixes were reused. Which sequences a static batch holds depends on
    # its fill timer, so the count varies by a few blocks between runs (498 once on CI).
    assert stats_on.prefix_cache_hits_total > 400
    prompts = shared_prefix_prompts()
    assert stats_on.prefix_cache_queries_total == sum(len(p) for p in prompts)
    if "kv_cache_tokens" in settings:
        assert stats_on.num_preemptions > 0


def test_a_failed_rows_prefix_is_not_reused(model_dir):
    """A sequence that fails (NaN logits) leaves a row the runner zeroes again: a later request
    sharing its clean prefix must recompute it, and get the cache-off answer."""
    system = tokens(60, 21)
    later = [*system, *tokens(4, 22)]
    expected = make_engine(model_dir, enable_prefix_caching=False).generate([later], greedy())
    engine = make_engine(model_dir, max_batch_size=1)
    with torch.no_grad():
        model_runner(engine).model.get_input_embeddings().weight[POISON] = float("nan")
    (failed,) = engine.generate([[*system, POISON]], greedy())
    assert failed.finish_reason == "error"
    (result,) = engine.generate([later], greedy())
    assert result.token_ids == expected[0].token_ids
    assert engine.stats().prefix_cache_hits_total == 0


def test_prefix_cache_metrics_use_vllm_names(model_dir):
    engine = make_engine(model_dir, max_batch_size=2)
    system = tokens(64, 31)
    engine.generate([[*system, 1]], greedy(2))
    engine.generate([[*system, 2, 3]], greedy(2))
    collector = EngineStatsCollector(lambda: "m", engine.stats, lambda: False)
    samples = {
        sample.name: sample.value
        for family in collector.collect()
        for sample in family.samples
        if sample.name.startswith("vllm:prefix_cache")
    }
    assert samples == {
        "vllm:prefix_cache_queries_total": 65 + 66,
        "vllm:prefix_cache_hits_total": 64,
    }
