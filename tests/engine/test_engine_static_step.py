"""The static decode step (issue 30), eager: the same tokens as HF generate() and the classic
path under continuous batching, the device sampler's rules, and no host sync inside a step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.model.host_sync import HostSyncCounter
from slotserve.engine.core.model.static_buffers import bucket_sizes, kv_buckets
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.sequence import Sequence
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    hf_greedy,
    make_engine,
    make_prompts,
    model_runner,
    run_staggered,
    static_decoder,
)

NUM_NEW = 24


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-static", smollm2_dir)


@pytest.fixture(scope="module")
def reference_model(sharp_model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(sharp_model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def test_buckets_cover_every_batch_and_span():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert bucket_sizes(6) == (1, 2, 4, 6)
    assert kv_buckets(2048) == (256, 512, 1024, 2048)
    assert kv_buckets(300) == (256, 300)
    assert kv_buckets(100) == (100,)


def test_static_step_equals_generate_under_staggered_arrivals_and_preemption(
    sharp_model_dir, reference_model
):
    prompts = make_prompts(18)
    # 6 slots (row buckets 1, 2, 4, 6) and a KV budget that cannot hold 6 growing sequences.
    engine = make_engine(
        sharp_model_dir,
        max_batch_size=6,
        max_batched_tokens=32,
        kv_cache_tokens=260,
        decode_step="static",
    )
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    seqs = run_staggered(engine, prompts, params, every=5, per=3)
    static = model_runner(engine).static
    assert static is not None and model_runner(engine).native_step is None
    assert engine.stats().num_preemptions > 0
    # Most decode steps went through the static step, in several row buckets.
    assert static.stats.num_steps > 40
    # Steps with a prefill chunk ran their decode rows static beside it.
    assert model_runner(engine).num_split_steps > 5
    assert len({rows for rows, _span, _full in static.stats.steps_per_bucket}) >= 3
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.generated_token_ids == hf_greedy(reference_model, prompt, NUM_NEW), (
            seq.request_id
        )


def test_rows_past_the_first_span_attend_to_all_their_positions(sharp_model_dir, reference_model):
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 49_000, (250,), generator=generator).tolist()  # decodes cross 256
    engine = make_engine(sharp_model_dir, max_batch_size=2, max_model_len=300, decode_step="static")
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    seq = run_staggered(engine, [prompt], params, every=1, per=1)[0]
    spans = {span for _rows, span, _full in static_decoder(engine).stats.steps_per_bucket}
    assert spans == {256, 300}
    assert seq.generated_token_ids == hf_greedy(reference_model, prompt, NUM_NEW)


def test_sampled_rows_match_the_rules(sharp_model_dir):
    engine = make_engine(sharp_model_dir, max_batch_size=4, decode_step="static")
    prompt = make_prompts(1)[0]
    top_k_1 = SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=3)
    alone = run_staggered(engine, [prompt], seeded, every=1, per=1)[0]
    # top_k 1 samples the argmax: greedy's tokens, next to a seeded row and a greedy one.
    rows = [engine.add_request(f"b{i}", prompt, p) for i, p in enumerate([top_k_1, greedy])]
    rows.append(engine.add_request("b2", prompt, seeded))
    while engine.has_unfinished():
        engine.step()
    assert static_decoder(engine).stats.steps_per_bucket.get((4, 256, True), 0) > 0
    assert rows[0].generated_token_ids == rows[1].generated_token_ids
    # A seeded request draws the same tokens alone and in a batch of three.
    assert rows[2].generated_token_ids == alone.generated_token_ids
    assert len(set(alone.generated_token_ids)) > 1  # it does sample, not echo the argmax


def test_logprobs_equal_the_eager_sampler(sharp_model_dir):
    """Greedy rows asking for logprobs: the device sampler's and the eager sampler's agree."""
    prompt = make_prompts(2)[1]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    results = {}
    for mode in ("classic", "static"):
        engine = make_engine(sharp_model_dir, max_batch_size=2, decode_step=mode)
        seq = engine.add_request("l", prompt, params)
        sampled = []
        while engine.has_unfinished():
            engine.step()
            sampled += [lp for lp in model_runner(engine).last_logprobs if lp is not None]
        results[mode] = (seq.generated_token_ids, sampled)
    (classic_ids, classic), (static_ids, static) = results["classic"], results["static"]
    assert static_ids == classic_ids and len(static) == len(classic) == 6
    for ours, theirs in zip(static, classic, strict=True):
        assert ours.token_id == theirs.token_id
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [i for i, _ in ours.top] == [i for i, _ in theirs.top]
        for (_, a), (_, b) in zip(ours.top, theirs.top, strict=True):
            assert a == pytest.approx(b, abs=1e-4)


def test_penalties_on_the_device_equal_the_eager_sampler(tiny_model_dir):
    """Penalized greedy rows next to plain ones, arriving staggered so that slots change
    owners: the same tokens as the classic path's eager penalties, and count rows rebuilt only
    when a slot changes owner. The tiny random model echoes its input, so penalties bite."""
    prompts = make_prompts(8, seed=4)
    kinds = [
        SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=2.0, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=17,
            temperature=0.0,
            frequency_penalty=2.0,
            presence_penalty=1.5,
            ignore_eos=True,
        ),
    ]
    results = {}
    for mode in ("classic", "static"):
        engine = make_engine(tiny_model_dir, max_batch_size=3, decode_step=mode)
        seqs: list[Sequence] = []
        step = 0
        while len(seqs) < len(prompts) or engine.has_unfinished():
            if step % 3 == 0 and len(seqs) < len(prompts):
                i = len(seqs)
                seqs.append(engine.add_request(f"p{i}", prompts[i], kinds[i % 3]))
            engine.step()
            step += 1
        results[mode] = [seq.generated_token_ids for seq in seqs]
        if mode == "static":
            static = static_decoder(engine)
            assert sum(n for (_r, _s, full), n in static.stats.steps_per_bucket.items() if full)
            assert 0 < static.transfers.num_set_ups <= 4 * len(prompts)
    assert results["static"] == results["classic"]
    # The penalties change the answer (else the test could not fail).
    plain = make_engine(tiny_model_dir, max_batch_size=3, decode_step="static")
    neutral = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    unpenalized = [
        run_staggered(plain, [prompts[i]], kinds[i].model_copy(update=neutral), every=1, per=1)
        for i in (0, 2)
    ]
    assert [seqs[0].generated_token_ids for seqs in unpenalized] != [
        results["static"][0],
        results["static"][2],
    ]


def test_min_tokens_bans_eos_on_the_device(sharp_model_dir, reference_model):
    prompt = make_prompts(3)[2]
    # Make EOS the model's first greedy choice: min_tokens must push it out.
    eos = hf_greedy(reference_model, prompt, 1)[0]
    engine = make_engine(sharp_model_dir, max_batch_size=2, decode_step="static")
    static_decoder(engine).eos_mask[eos] = True
    params = SamplingParams(max_tokens=4, temperature=0.0, min_tokens=4, ignore_eos=True)
    plain = run_staggered(engine, [prompt], params, every=1, per=1)[0]
    banned = SamplingParams(max_tokens=4, temperature=0.0, min_tokens=4)
    seq = run_staggered(engine, [prompt], banned, every=1, per=1)[0]
    assert plain.generated_token_ids[0] == eos  # prefill samples eagerly: it may pick EOS
    assert eos not in seq.generated_token_ids[1:]  # decode steps ran static and banned it


def test_no_host_sync_inside_a_static_step(sharp_model_dir):
    engine = make_engine(sharp_model_dir, max_batch_size=4, decode_step="static")
    static = static_decoder(engine)
    prompts = make_prompts(6)
    mixed = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, top_k=40, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, seed=3, logprobs=2, ignore_eos=True),
    ]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, mixed[i % 3])
    num_static = 0
    while engine.has_unfinished():
        before = (static.stats.num_steps, static.transfers.num_to_device)
        splits = model_runner(engine).num_split_steps
        with HostSyncCounter(static.transfers) as counter:
            engine.step()
        if static.stats.num_steps == before[0] or model_runner(engine).num_split_steps > splits:
            continue  # a step with prefill: the transformers path ran too
        num_static += 1
        assert counter.others == [], counter.others
        assert counter.allowed <= 2  # the result read (and on CUDA the input copy)
        assert static.transfers.num_to_device == before[1] + 1
    assert num_static > 10


def test_the_counter_finds_the_classic_paths_syncs(sharp_model_dir):
    """The hook is not blind: the transformers path's input tensors and reads are found."""
    engine = make_engine(sharp_model_dir, max_batch_size=2, decode_step="classic")
    engine.add_request("c", make_prompts(1)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    with HostSyncCounter() as counter:
        while engine.has_unfinished():
            engine.step()
    assert "tensor" in counter.others and "tolist" in counter.others


def test_static_refuses_quantization_and_other_backends(sharp_model_dir):
    with pytest.raises(UnsupportedSettingError, match="decode_step static"):
        make_engine(sharp_model_dir, decode_step="static", linear_backend="onednn")


def test_gpu_memory_leaves_room_for_the_largest_step_and_refuses_what_cannot_fit():
    from transformers import LlamaConfig

    from slotserve.engine.core.model.static_memory import headroom_bytes, kv_budget_bytes

    config = LlamaConfig(  # Llama-3-8B's shape
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    )
    small = headroom_bytes(
        config, torch.bfloat16, max_batched_tokens=512, max_model_len=2048, num_slots=8
    )
    large = headroom_bytes(
        config, torch.bfloat16, max_batched_tokens=8192, max_model_len=8192, num_slots=64
    )
    assert 1 << 30 < small < large
    assert large > 16 << 30  # 8,192-token chunks over 8,192-position rows: scores and logits
    assert kv_budget_bytes(40 << 30, small, 0.5) == pytest.approx(0.5 * ((40 << 30) - small))
    with pytest.raises(UnsupportedSettingError, match="max_batched_tokens, max_model_len"):
        kv_budget_bytes(12 << 30, large, 0.9)


def test_static_sizing_fuses_before_reading_free_memory(sharp_model_dir):
    from slotserve.engine.core.model.fusion import FusedGatedMLP, QKVPart
    from slotserve.engine.core.model.loader import load_model
    from slotserve.engine.core.model.static_memory import fuse_before_sizing

    model, _ = load_model(str(sharp_model_dir), torch.device("cpu"), torch.float32)
    fuse_before_sizing(model)
    layer = model.get_decoder().layers[0]
    assert isinstance(layer.self_attn.q_proj, QKVPart) and isinstance(layer.mlp, FusedGatedMLP)
    fuse_before_sizing(model)  # idempotent, as the runner's own set-up then fuses again
    assert isinstance(model.get_decoder().layers[0].mlp, FusedGatedMLP)
