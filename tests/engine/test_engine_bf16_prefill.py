"""Prefill products in bfloat16 (issue 24, item 2): with ``prefill_dtype bfloat16`` a prefill
chunk's decoder products run as bf16 GEMMs on bf16 copies of the weights (fp32 accumulation),
decode steps stay fp32 in the native step, the output projection stays fp32; a CPU without bf16
units keeps fp32 prefill with a warning (quantized models: test_engine_quantized_bf16.py). The
real model's prompt logprobs under bf16 prefill stay close to fp32's (the quality figures are
bench/quant_quality.py's).

On a CPU without bf16 units the tests that need the bf16 path claim the flags (torch then
emulates bf16: slower, same numbers), so they run on every machine.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import torch.nn.functional as F

from slotserve.engine.core.kernels import ISAS, load_kernels
from slotserve.engine.core.model import bf16_prefill
from slotserve.engine.core.model.native_linear import NativeLinear, onednn_bf16
from slotserve.engine.core.params import SamplingParams
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import make_engine, model_runner


def claim_cpu(monkeypatch: pytest.MonkeyPatch, *, onednn: bool) -> None:
    """This CPU as one with bf16 units, whatever it has. ``onednn``: its kernels multiply no bf16
    (the instruction set lowered to ``avx512``), so prefill's wide bf16 products go to oneDNN;
    else, where the kernels run AVX512_BF16, they are the kernels' own on packed weights."""
    real = bf16_prefill.cpu_identity()
    flags = [flag for flag in real["cpu_flags"].split() if not flag.startswith("amx")]
    flags += ["avx512_bf16", "amx_bf16"] if onednn else ["avx512_bf16"]
    claimed = {**real, "cpu_flags": " ".join(flags)}
    monkeypatch.setattr(bf16_prefill, "cpu_identity", lambda: claimed)


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    claim_cpu(monkeypatch, onednn=False)


@pytest.fixture
def onednn_cpu(monkeypatch: pytest.MonkeyPatch):
    claim_cpu(monkeypatch, onednn=True)
    kernels = load_kernels(CommonSettings().home)
    kernels.set_isa("avx512")
    try:
        yield
    finally:
        kernels.set_isa(ISAS[-1])


def kernels_run_bf16() -> bool:
    from slotserve.engine.core.kernels import load_kernels
    from slotserve.settings import CommonSettings

    return load_kernels(CommonSettings().home).isa == "avx512_bf16"


def native_bf16_engine(model_dir, max_batch_size: int):
    """An engine whose prefill and decode products are bf16 on the native kernels."""
    return make_engine(
        model_dir,
        prefill_dtype="bfloat16",
        decode_dtype="bfloat16",
        linear_backend="native",
        max_batch_size=max_batch_size,
    )


def decoder_layers(engine) -> list[NativeLinear]:
    return bf16_prefill.decoder_linears(model_runner(engine).model)


def test_prefill_chunks_multiply_in_bf16_and_decode_steps_stay_native_fp32(
    tiny_model_dir, onednn_cpu
):
    engine = make_engine(
        tiny_model_dir, prefill_dtype="bfloat16", linear_backend="native", max_batch_size=2
    )
    runner = model_runner(engine)
    step = runner.native_step
    assert runner.prefill_bf16 and step is not None and step.prefill  # prefill stays native
    layers = decoder_layers(engine)
    assert len(layers) == 4 * 2  # q/k/v (fused), o, gate/up, down of both layers
    assert all(layer.weight_bf16 is not None for layer in layers)
    output = runner.model.get_output_embeddings()
    assert getattr(output, "weight_bf16", None) is None  # logits stay fp32

    # The layers' own path (steps the native step does not take): wide rows in bf16.
    layer = layers[0]
    assert layer.weight_fp32 is not None and layer.weight_bf16 is not None
    assert torch.equal(layer.weight_bf16, layer.weight_fp32.to(torch.bfloat16))
    assert runner.bf16_gate is not None
    runner.bf16_gate.on = True  # as the runner sets it for a prefill step
    wide = torch.randn(layer.max_native_rows + 7, layer.in_features)
    expected = F.linear(wide.to(torch.bfloat16), layer.weight_bf16).float()
    if layer.bias is not None:
        expected += layer.bias
    assert torch.equal(layer(wide), expected)
    narrow = wide[:1]
    fp32 = F.linear(narrow.double(), layer.weight_fp32.double()).float()
    assert torch.allclose(layer(narrow), fp32, atol=1e-5)  # one row: native fp32, not bf16

    # In the native step: a prefill chunk's 4 products a layer go through the bf16 callback,
    # decode steps' and a scoring step's do not.
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [(i * 31 + 7) % 4000 + 50 for i in range(40)]
    engine.add_request("wide", prompt, params)
    engine.step()  # the whole 40-token prompt in one chunk
    assert step.wide_products == 4 * 2
    while engine.has_unfinished():
        engine.step()
    assert step.wide_products == 4 * 2  # decode steps: fp32 native products
    scoring = params.model_copy(update={"prompt_logprobs": 1, "max_tokens": 1})
    engine.generate([prompt[::-1]], scoring)
    assert step.wide_products == 4 * 2  # a scored prompt stays fp32
    # A decode-only step wider than the native rows (the transformers path) stays fp32 too.
    engine.generate([[11, 12], [13, 14]], params)
    assert runner.bf16_gate is not None and not runner.bf16_gate.on


def test_without_amx_prefill_multiplies_on_the_native_kernels_packed_weights(
    tiny_model_dir, monkeypatch
):
    """AVX512_BF16 without AMX (a Zen 4): every product of a prefill step runs on the packed
    bf16 weights in the native step, no oneDNN callback and no plain copy; decode-only steps
    (decode_dtype float32 here) and a scored prompt stay fp32."""
    if not kernels_run_bf16():
        pytest.skip("the kernels do not run AVX512_BF16 on this CPU")
    claim_cpu(monkeypatch, onednn=False)
    engine = make_engine(
        tiny_model_dir, prefill_dtype="bfloat16", linear_backend="native", max_batch_size=2
    )
    runner = model_runner(engine)
    step = runner.native_step
    assert runner.prefill_bf16 and step is not None and step.prefill and not step.bf16_products
    layers = decoder_layers(engine)
    assert all(layer.weight_packed is not None and layer.weight_bf16 is None for layer in layers)
    gate = runner.bf16_gate
    assert gate is not None
    seen = []
    real_call = step.kernels.llama_step

    def spy(struct, *args):
        seen.append(gate.on)
        return real_call(struct, *args)

    monkeypatch.setattr(step.kernels, "llama_step", spy)  # the kernels object is shared
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.generate([[(i * 31 + 7) % 4000 + 50 for i in range(40)]], params)
    assert seen == [True, False, False]  # the prefill step in bf16, the two decode steps not
    seen.clear()
    engine.generate([[5, 6, 7, 8]], params.model_copy(update={"prompt_logprobs": 1}))
    assert seen and not seen[0]  # a scored prompt: fp32


@pytest.mark.parametrize("route", ["onednn", "packed"])
def test_native_and_module_bf16_prefill_agree(tiny_model_dir, request, route):
    """The native step with bf16 products and the layers' torch path with them compute the
    same step (up to fp32 rounding order around the products), on either route: oneDNN's
    GEMMs (kernels that multiply no bf16) or the native kernels on packed weights (the AMX
    tiles from 16 rows where the CPU has them, VDPBF16PS)."""
    if route == "packed" and not kernels_run_bf16():
        pytest.skip("the kernels do not run AVX512_BF16 on this CPU")
    request.getfixturevalue("onednn_cpu" if route == "onednn" else "bf16_cpu")
    prompts = [[(i * 13 + 5 * j) % 4000 + 50 for i in range(70 + 9 * j)] for j in range(3)]
    figures = []
    for native in (True, False):
        engine = make_engine(
            tiny_model_dir, prefill_dtype="bfloat16", linear_backend="native", max_batch_size=3
        )
        step = model_runner(engine).native_step
        assert step is not None
        step.prefill = native
        layers = decoder_layers(engine)
        assert all((layer.weight_packed is not None) == (route == "packed") for layer in layers)
        figures.append(first_token_logprobs(engine, prompts))
        assert (step.wide_products > 0) == (native and route == "onednn")
    for ours, theirs in zip(*figures, strict=True):
        assert ours.keys() == theirs.keys()
        for token, logprob in ours.items():
            assert logprob == pytest.approx(theirs[token], abs=2e-3)


def test_a_failing_bf16_product_fails_the_step_with_its_own_error(tiny_model_dir, onednn_cpu):
    engine = make_engine(tiny_model_dir, prefill_dtype="bfloat16", linear_backend="native")
    step = model_runner(engine).native_step
    assert step is not None
    step._bf16 = [torch.zeros(3, 5, dtype=torch.bfloat16)] * len(step._bf16)  # wrong shapes
    gate = model_runner(engine).bf16_gate
    assert gate is not None
    gate.on = True  # as the runner sets it for a prefill step
    with pytest.raises(RuntimeError):
        step(list(range(100, 170)), list(range(70)), [0] * 70)
    assert step._wide_error is None  # handed over, not kept for the next step
    step(list(range(100, 103)), list(range(3)), [1] * 3)  # narrow steps never call it


def test_auto_takes_bf16_where_it_can_run_and_fp32_silently_elsewhere(
    tiny_model_dir, monkeypatch, caplog
):
    identity = bf16_prefill.cpu_identity()
    monkeypatch.setattr(
        bf16_prefill, "cpu_identity", lambda: {**identity, "cpu_flags": "avx2 fma amx_bf16"}
    )
    engine = make_engine(tiny_model_dir, prefill_dtype="auto", linear_backend="native")
    assert model_runner(engine).prefill_bf16
    monkeypatch.setattr(bf16_prefill, "cpu_identity", lambda: {**identity, "cpu_flags": "avx2 fma"})
    # An AVX2 CPU: no bf16 units. fp32 weights take int16 products there (int16_products.py:
    # the narrow gate on, int16 copies, no bf16 ones); quantized weights stay as they are.
    kernels = load_kernels(CommonSettings().home)
    kernels.set_isa("avx2_fma")
    try:
        with caplog.at_level(logging.INFO, logger=bf16_prefill.__name__):
            engine = make_engine(tiny_model_dir, prefill_dtype="auto", linear_backend="native")
            quantized = make_engine(tiny_model_dir, prefill_dtype="auto", quantization="int8")
    finally:
        kernels.set_isa(ISAS[-1])
    assert model_runner(engine).prefill_bf16 and not model_runner(quantized).prefill_bf16
    layers = decoder_layers(engine)
    assert all(layer.weight_int16 is not None and layer.weight_bf16 is None for layer in layers)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # auto never warns
    assert "prefill products in float32: no bf16 units" in caplog.text


def test_the_engine_default_is_auto():
    from slotserve.engine.settings import EngineSettings

    assert EngineSettings.model_fields["prefill_dtype"].default == "auto"


def test_a_cpu_without_bf16_units_keeps_fp32_prefill(tiny_model_dir, monkeypatch, caplog):
    bare = {**bf16_prefill.cpu_identity(), "cpu_flags": "fpu sse2 avx2 fma"}
    monkeypatch.setattr(bf16_prefill, "cpu_identity", lambda: bare)
    with caplog.at_level(logging.WARNING, logger=bf16_prefill.__name__):
        engine = make_engine(tiny_model_dir, prefill_dtype="bfloat16", linear_backend="native")
    assert not model_runner(engine).prefill_bf16
    assert all(layer.weight_bf16 is None for layer in decoder_layers(engine))
    assert "needs a CPU with AMX-BF16 or AVX512_BF16" in caplog.text
    # A quantized model: test_engine_quantized_bf16.py.


SENTENCES = [
    "The river ran past the old mill and under the stone bridge, where children threw sticks "
    "into the water and raced to the other side to see whose stick came out first.",
    "In the autumn the leaves collected against the arches, and the miller's dog barked at the "
    "ducks that gathered there each morning before the market opened in the square.",
    "A committee of engineers reviewed the proposal for a new railway line between the two "
    "cities and concluded that the tunnel under the hills would cost more than expected.",
    "She opened the letter slowly, read the first line twice, and then set it down on the "
    "table beside the cold cup of tea that she had forgotten to drink an hour before.",
]


REQUESTS = itertools.count()  # request ids unique across calls on one engine


def first_token_logprobs(
    engine, prompts: list[list[int]], position: int = 0
) -> list[dict[str, float]]:
    """The five most likely tokens, with logprobs, at each prompt's greedy continuation's
    ``position`` (0: the prefill step's choice, 1: the first decode step's)."""
    params = SamplingParams(temperature=0.0, max_tokens=position + 1, logprobs=5)
    ids = [f"q{next(REQUESTS)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    found: dict[str, list[dict[str, float]]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            for entry in output.logprobs or []:
                found[output.request_id].append(dict(entry.top))
    return [found[request_id][position] for request_id in ids]


@pytest.mark.slow
def test_smollm2_under_bf16_prefill_stays_close_to_fp32_and_scores_exactly(smollm2_dir, bf16_cpu):
    """The real model on real text: bf16 prefill moves the next token's logprob a little and
    keeps its top-1 choice; a request that scores its prompt runs in fp32 even so (lm-eval's
    loglikelihoods must equal fp32's to 1e-3 a token)."""
    engines = {
        dtype: make_engine(smollm2_dir, prefill_dtype=dtype, max_model_len=256, num_threads=2)
        for dtype in ("float32", "bfloat16")
    }
    assert model_runner(engines["bfloat16"]).prefill_bf16
    texts = [f"{a} {b}" for a, b in zip(SENTENCES, SENTENCES[1:] + SENTENCES[:1], strict=True)]
    prompts = [engines["float32"].tokenizer.encode(text) for text in texts]
    widest_native = max(layer.max_native_rows for layer in decoder_layers(engines["bfloat16"]))
    assert min(len(p) for p in prompts) > widest_native  # wide enough for the bf16 products
    fp32 = first_token_logprobs(engines["float32"], prompts)
    bf16 = first_token_logprobs(engines["bfloat16"], prompts)
    deltas = []
    for ours, theirs in zip(bf16, fp32, strict=True):
        token = max(ours, key=ours.__getitem__)  # bf16's choice
        best = max(theirs.values())
        # The same choice, or a near-tie of fp32's that bf16's rounding tipped.
        assert token in theirs and best - theirs[token] < 0.05, (ours, theirs)
        deltas.append(abs(ours[token] - theirs[token]))
    print(f"first-token logprob deltas under bf16 prefill: {deltas}")
    assert 0 < max(deltas) < 0.1  # bf16 did run, and moved it little

    scored: dict[str, list[float]] = {}
    for dtype, engine in engines.items():
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        seq = engine.add_request(f"score-{dtype}", prompts[0], params)
        while engine.has_unfinished():
            engine.step()
        assert seq.prompt_logprobs is not None
        scored[dtype] = []
        for entry in seq.prompt_logprobs[1:]:
            assert entry is not None  # every prompt token after the first has its logprob
            scored[dtype].append(entry.logprob)
    assert scored["bfloat16"] == pytest.approx(scored["float32"], abs=1e-4)


def test_layers_stay_native_for_bf16_prefill_where_aten_wins_every_decode_size(
    tiny_model_dir, bf16_cpu, monkeypatch
):
    """Where the calibration finds aten's products faster at every decode size (this Intel
    Xeon, quiet), the layers still become native, at 0 native rows: decode products are aten's
    as before, and the native step exists for prefill chunks with bf16 products."""
    from slotserve.engine.core.model import linear_setup

    monkeypatch.setattr(linear_setup, "choose_native_rows", lambda *a, **k: (0, None, None))
    engine = make_engine(tiny_model_dir, prefill_dtype="auto")
    runner = model_runner(engine)
    assert runner.prefill_bf16 and runner.native_step is not None
    assert {layer.max_native_rows for layer in decoder_layers(engine)} == {0}
    assert runner.native_step.max_rows == 0  # decode steps: the transformers path
    fp32 = make_engine(tiny_model_dir, prefill_dtype="float32")
    assert model_runner(fp32).native_step is None and not decoder_layers(fp32)  # as before


def test_on_amx_products_of_16_rows_or_more_run_on_the_tiles_with_fp32_results(tiny_model_dir):
    """On an AMX CPU the packed bf16 weights serve every product, prefill's and decode's and
    the output projection's: no plain bf16 copy, no oneDNN callback; from 16 rows the tiles
    (gemm_amx.c) multiply them, with the same results as VDPBF16PS up to the fp32 summation
    order (oneDNN's bf16 results had cost the bf16 path 2 points of greedy agreement)."""
    kernels = load_kernels(CommonSettings().home)
    if not kernels.amx:
        pytest.skip("this CPU (or its kernel) gives no AMX tiles")
    engine = native_bf16_engine(tiny_model_dir, max_batch_size=20)
    runner = model_runner(engine)
    step = runner.native_step
    assert step is not None and not step.bf16_products  # no oneDNN callback
    layers = decoder_layers(engine)
    assert all(layer.weight_packed is not None and layer.weight_bf16 is None for layer in layers)
    logits = runner.logits
    assert isinstance(logits, NativeLinear) and logits.weight_packed is not None
    assert logits.weight_bf16 is None

    layer = layers[0]
    assert layer.weight_packed is not None and runner.bf16_gate is not None
    runner.bf16_gate.on = True
    for num_rows in (15, 16, 20, 40):
        rows = torch.randn(num_rows, layer.in_features)
        got = layer(rows) - (layer.bias if layer.bias is not None else 0)
        kernels.set_amx(False)
        try:
            vectors = kernels.gemm_bf16(rows, layer.weight_packed, layer.out_features)
        finally:
            kernels.set_amx(True)
        torch.testing.assert_close(got, vectors, rtol=1e-5, atol=1e-5)

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(16):
        engine.add_request(f"r{i}", [50 + i, 60 + i], params)
    while engine.has_unfinished():
        engine.step()  # a prefill step of 32 rows, then decode steps of 16
    assert step.wide_products == 0


def test_on_amx_a_prefill_step_runs_its_layers_on_the_tiles_and_agrees_with_vdpbf16ps(
    tiny_model_dir, monkeypatch
):
    """With AMX, a bf16 step of 16 rows or more runs each layer on the tiles end to end
    (llama_step.c's layer_on_tiles: norms straight to bf16 tiles, the fused MLP, o and down
    added to the residual stream, the tiles' attention); the same prompts with the tiles off
    (VDPBF16PS products and attention, each op on its own) give the same next-token logprobs up
    to the bf16 roundings' order."""
    kernels = load_kernels(CommonSettings().home)
    if not kernels.amx:
        pytest.skip("this CPU (or its kernel) gives no AMX tiles")
    prompts = [[(i * 17 + 3 * j) % 4000 + 50 for i in range(40 + 11 * j)] for j in range(3)]
    figures = []
    engine = make_engine(
        tiny_model_dir, prefill_dtype="bfloat16", linear_backend="native", max_batch_size=3
    )
    for amx in (True, False):
        kernels.set_amx(amx)
        try:
            figures.append(first_token_logprobs(engine, prompts))
        finally:
            kernels.set_amx(True)
    for tiles, vectors in zip(*figures, strict=True):
        assert tiles.keys() == vectors.keys()
        for token, logprob in tiles.items():
            assert logprob == pytest.approx(vectors[token], abs=2e-3)
    assert figures[0] != figures[1]  # the tiles did run: another rounding order somewhere


def greedy_logprobs(engine, prompts: list[list[int]], tokens: int) -> list[list[dict]]:
    """Every step's five most likely tokens, with logprobs, over ``tokens`` greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=5, ignore_eos=True)
    ids = [f"g{next(REQUESTS)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    found: dict[str, list[dict]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            found[output.request_id] += [dict(entry.top) for entry in output.logprobs or []]
    return [found[request_id] for request_id in ids]


def test_with_vdpbf16ps_the_step_fuses_its_layers_on_bf16_rows_bit_for_bit(tiny_model_dir):
    """Where the kernels multiply bf16 with VDPBF16PS (AMX off, or under its 16 rows), a bf16
    step runs each layer fused (llama_step.c's layer_on_rows: the norms write bf16 rows, the
    MLP is one call whose silu(gate) * up never leaves the registers, o and down add into the
    residual stream), with the same roundings and sums as the products one by one: prefill and
    decode steps give the same logprobs to the bit."""
    kernels = load_kernels(CommonSettings().home)
    if kernels.isa != "avx512_bf16":
        pytest.skip("the kernels multiply no bf16 on this CPU")
    engine = native_bf16_engine(tiny_model_dir, max_batch_size=3)
    # 40 + 51 + 62 prompt rows in one prefill step, then decode steps of 3 rows.
    prompts = [[(i * 17 + 3 * j) % 4000 + 50 for i in range(40 + 11 * j)] for j in range(3)]
    amx = kernels.amx  # set_amx returns what runs after it, not before
    kernels.set_amx(False)
    figures, runs = [], []
    try:
        for fused in (True, False):
            kernels.set_fused_layers(fused)
            before = kernels.fused_layers_run()
            figures.append(greedy_logprobs(engine, prompts, tokens=4))
            runs.append(kernels.fused_layers_run() - before)
    finally:
        kernels.set_fused_layers(True)
        kernels.set_amx(amx)
    assert runs[0] >= 2 * 4 and runs[1] == 0  # 2 layers a step, 4 steps or more
    assert figures[0] == figures[1]
    assert all(len(steps) == 4 for steps in figures[0])


@pytest.mark.parametrize("num_rows", [1, 15, 16, 17, 40])
def test_onednn_products_pad_rows_to_a_bucket_and_give_the_unpadded_result(num_rows):
    """Rows padded to a multiple of 16 keep oneDNN's kernels per shape few; the padding rows
    never reach the result, and each row's product is the unpadded GEMM's."""
    weight = (torch.randn(48, 64) * 0.1).to(torch.bfloat16)
    rows = torch.randn(num_rows, 64)
    got = onednn_bf16(rows, weight)
    assert got.shape == (num_rows, 48) and got.dtype == torch.bfloat16
    expected = F.linear(rows.to(torch.bfloat16), weight)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=1e-2)
    reference = rows.to(torch.bfloat16).double() @ weight.double().T
    torch.testing.assert_close(got.double(), reference, rtol=1e-2, atol=1e-2)
