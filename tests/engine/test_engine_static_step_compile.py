"""The static decode step compiles whole (issue 30): torch.compile(fullgraph=True,
dynamic=False) for every row bucket, no graph break, no recompile over hundreds of steps whose
rows come and go; tokens equal the eager step's and HF generate()'s.

The capture proof uses dynamo with the ``eager`` backend: graph breaks and recompiles are
decided by dynamo before any backend, and inductor's C++ compile takes ~25 s a graph on this
small shared CPU. One test compiles for real with inductor, for one bucket.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.model.static_decoder import StaticDecoder
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.sequence import Sequence
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    make_engine,
    model_runner,
    static_decoder,
)

NUM_REQUESTS = 56


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-compile", smollm2_dir)


def compiled_engine(model_dir, *, max_batch_size: int, backend: str, overlap: str = "off"):
    engine = make_engine(
        model_dir,
        max_batch_size=max_batch_size,
        max_model_len=256,
        decode_step="static",
        overlap_steps=overlap,
    )
    runner = model_runner(engine)
    runner.static = StaticDecoder(
        runner.model,
        runner.k_cache,
        runner.v_cache,
        num_slots=runner.num_slots,
        max_model_len=runner.max_model_len,
        eos_token_ids=frozenset(),
        compile=True,
        backend=backend,
    )
    return engine


def workload(engine: LLMEngine, *, seed: int = 0) -> list[list[int]]:
    """Requests of 3-37 new tokens arriving every fourth step, greedy only in the first half,
    then sampled (seeded, so two runs must agree) and with logprobs too: rows join and leave
    the batch all the time."""
    generator = torch.Generator().manual_seed(seed)
    kinds = [
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.9, top_p=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=1.2, top_k=20, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, ignore_eos=True),
    ]
    seqs: list[Sequence] = []
    step = 0
    while len(seqs) < NUM_REQUESTS or engine.has_unfinished():
        if step % 4 == 0 and len(seqs) < NUM_REQUESTS:
            i = len(seqs)
            prompt = torch.randint(
                3,
                49_000,
                (int(torch.randint(2, 24, (1,), generator=generator)),),
                generator=generator,
            )
            kind = kinds[0] if i < NUM_REQUESTS // 2 else kinds[i % 4]
            params = kind.model_copy(update={"max_tokens": 3 + (i * 7) % 35})
            seqs.append(engine.add_request(f"w{i}", prompt.tolist(), params))
        engine.step()
        step += 1
        assert step < 5000
    return [seq.generated_token_ids for seq in seqs]


def test_every_bucket_compiles_whole_and_never_again(sharp_model_dir):
    engine = compiled_engine(sharp_model_dir, max_batch_size=4, backend="eager")
    static = static_decoder(engine)
    counters.clear()
    static.warm_up(full=True)  # buckets 1, 2, 4; greedy and sampling
    assert static.row_buckets == (1, 2, 4)
    assert static.stats.num_compiles == 6
    assert counters["stats"]["unique_graphs"] == 6
    assert not counters["graph_break"]
    # From here any guard failure raises instead of compiling again.
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens = workload(engine)
    assert static.stats.num_steps >= 200, static.stats.num_steps
    used = {(rows, full) for rows, _span, full in static.stats.steps_per_bucket}
    assert used == {(rows, full) for rows in (1, 2, 4) for full in (False, True)}
    assert static.stats.num_compiles == 6 and static.stats.num_compile_failures == 0
    assert counters["stats"]["unique_graphs"] == 0
    assert not counters["graph_break"] and not counters["recompiles"]
    # The eager step (no dynamo at all) gives the same tokens.
    eager = make_engine(sharp_model_dir, max_batch_size=4, max_model_len=256, decode_step="static")
    assert workload(eager) == tokens


def test_overlapped_compiled_steps_never_recompile(sharp_model_dir):
    """Overlapped steps (each chained step's input tokens read on the device from the step
    before) through the compiled buckets: still no graph break or recompile, the same tokens
    as the eager step without overlap."""
    engine = compiled_engine(sharp_model_dir, max_batch_size=4, backend="eager", overlap="on")
    static = static_decoder(engine)
    static.warm_up(full=True)
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens = workload(engine, seed=1)
    assert engine.overlap.num_chained >= 40, engine.overlap.num_chained
    assert static.stats.num_compiles == 6 and static.stats.num_compile_failures == 0
    assert counters["stats"]["unique_graphs"] == 0
    assert not counters["graph_break"] and not counters["recompiles"]
    eager = make_engine(sharp_model_dir, max_batch_size=4, max_model_len=256, decode_step="static")
    assert workload(eager, seed=1) == tokens


def test_a_compile_during_traffic_leaves_live_rows_alone(sharp_model_dir):
    """Without warm-up, buckets compile while sequences hold slots: the compiling calls run
    on padding rows, so the tokens (penalty counts included) are the eager step's."""
    engine = compiled_engine(sharp_model_dir, max_batch_size=2, backend="eager")
    eager = make_engine(sharp_model_dir, max_batch_size=2, max_model_len=256, decode_step="static")
    prompts = [[5, 900, 31_000, 77], [12, 4_000, 8]]
    params = SamplingParams(
        max_tokens=12, temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0
    )
    outputs = []
    for each in (engine, eager):
        seqs = [each.add_request(f"t{i}", p, params) for i, p in enumerate(prompts)]
        while each.has_unfinished():
            each.step()
        outputs.append([seq.generated_token_ids for seq in seqs])
    assert static_decoder(engine).stats.num_compiles >= 1
    assert outputs[0] == outputs[1]


def test_inductor_compiled_step_equals_generate(sharp_model_dir):
    reference = AutoModelForCausalLM.from_pretrained(str(sharp_model_dir), dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    engine = compiled_engine(sharp_model_dir, max_batch_size=1, backend="inductor")
    static_decoder(engine).warm_up()
    assert static_decoder(engine).stats.num_compiles == 1
    generator = torch.Generator().manual_seed(3)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(2):
        prompt = torch.randint(3, 49_000, (9 + 13 * i,), generator=generator).tolist()
        seq = engine.add_request(f"i{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
        with torch.inference_mode():
            # transformers types from_pretrained's result as a class that does not match
            # generate's own self-type protocol, though the loaded model is both.
            expected = reference.generate(  # type: ignore[misc]
                torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert seq.generated_token_ids == expected
    assert static_decoder(engine).stats.num_compiles == 1  # no recompile for the second request
