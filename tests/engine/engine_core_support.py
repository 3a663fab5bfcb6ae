"""Helpers for the engine-core tests: a tiny model whose greedy choices depend on context, and an
engine served in process over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp.test_utils import TestClient, TestServer

from slotserve.engine.core.engine import LLMEngine
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.sequence import Sequence
from slotserve.engine.settings import EngineSettings

if TYPE_CHECKING:
    import torch

    from slotserve.engine.core.model.runner import ModelRunner
    from slotserve.engine.core.model.static_decoder import StaticDecoder
    from slotserve.engine.core.protocols import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@contextlib.asynccontextmanager
async def served_in_process(model_dir: Path, **settings: Any) -> AsyncIterator[TestClient]:
    """An engine on ``model_dir`` (served as "tiny", one thread, ``settings`` on top) loaded in
    this process behind its HTTP app, ready (30 s at most), closed on the way out."""
    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.http.server import create_app

    settings = {"served_model_name": "tiny", "num_threads": 1, **settings}
    engine_settings = EngineSettings(model=str(model_dir), **settings)
    engine = await asyncio.to_thread(AsyncEngine.load, engine_settings)
    client = TestClient(TestServer(create_app(engine)))
    await client.start_server()
    try:
        async with asyncio.timeout(30):
            while (await client.get("/ready")).status != 200:
                await asyncio.sleep(0.05)
        yield client
    finally:
        await client.close()


ARCHITECTURES: dict[str, tuple[str, dict[str, object]]] = {
    # name: (config class, extra config fields)
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "phi3": ("Phi3Config", {}),
}


def build_sharp_tiny_model(
    dest: Path,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    arch: str = "llama",
    config: dict[str, object] | None = None,
) -> Path:
    """A 2-layer Llama (hidden 64, 4 heads, 2 kv heads) with weights scaled for sharp choices.

    With default init, attention is near-uniform and the output head echoes the input token, so
    a test could not tell correct attention from broken attention. Here attention logits are
    large, the output head is untied, and greedy outputs change from token to token.
    """
    if (dest / "config.json").is_file():
        return dest
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config_name, extra = ARCHITECTURES[arch]
    extra = {**extra, **(config or {})}
    model_config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                scale = 3.0 if name.endswith(("q_proj", "k_proj")) else 1.0
                module.weight.normal_(0.0, scale / math.sqrt(module.in_features))
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
        model.get_output_embeddings().weight.mul_(4.0)
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(str(tmp))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    tmp.rename(dest)
    return dest


def make_engine(model_dir: Path, **settings) -> LLMEngine:
    settings.setdefault("max_model_len", 512)
    # One torch thread: with 2 cores shared by parallel test processes, OpenMP threads that
    # spin at every barrier make each step up to 10x slower than a single thread.
    settings.setdefault("num_threads", 1)
    return LLMEngine.load(EngineSettings(model=str(model_dir), **settings))


def engine_tokenizer(model_dir: Path) -> Tokenizer:
    """``model_dir``'s tokenizer as the engine holds it (what the loader returns)."""
    from transformers import AutoTokenizer

    # transformers types decode() and apply_chat_template() for every input shape and flag; for
    # what the engine calls they are what Tokenizer declares (as the loader's load_model).
    return AutoTokenizer.from_pretrained(str(model_dir))  # type: ignore[return-value]


def model_runner(engine: LLMEngine) -> ModelRunner:
    """``engine``'s runner as the loader builds it: the tests reach into its own parts (the native
    step, the static decoder, the KV rows), which the engine's ``Runner`` protocol does not name."""
    from slotserve.engine.core.model.runner import ModelRunner

    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    return runner


def static_decoder(engine: LLMEngine) -> StaticDecoder:
    """``engine``'s static decode step, which the test relies on having been built."""
    static = model_runner(engine).static
    assert static is not None, "the engine should decode through the static step"
    return static


def run_staggered(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    every: int,
    per: int,
    max_steps: int = 2000,
) -> list[Sequence]:
    """Step the engine to the end, adding ``per`` new requests every ``every`` steps."""
    seqs: list[Sequence] = []
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if step % every == 0:
            for i, prompt in pending[:per]:
                seqs.append(engine.add_request(f"r{i}", prompt, params))
            pending = pending[per:]
        engine.step()
        step += 1
        assert step < max_steps, "the engine did not finish"
    return seqs


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of ``prompt``: what the engine must reproduce."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def make_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """``num`` random prompts of different lengths, the same for a seed."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = [3 + (i * 7) % 61 for i in range(num)]  # 3 .. 63 tokens, all different-ish
    return [torch.randint(3, 49_000, (n,), generator=generator).tolist() for n in lengths]


def runner_on(model, *, num_slots: int, max_model_len: int, native_kernels: bool = True, **options):
    """A runner of ``num_slots`` rows on ``model`` prepared as the loader prepares it: with the
    native kernels (unless ``native_kernels`` is False), calibrated for ``num_slots`` rows;
    ``options``: prepare_model's (``calibration``, ``linear_backend``, ``quantization``, ...)."""
    from slotserve.engine.core.kernels import load_kernels
    from slotserve.engine.core.model.prepare import prepare_model
    from slotserve.engine.core.model.runner import ModelRunner
    from slotserve.settings import CommonSettings

    kernels = load_kernels(CommonSettings().home) if native_kernels else None
    prepared = prepare_model(model, kernels, max_rows=num_slots, **options)
    return ModelRunner(prepared, num_slots=num_slots, max_model_len=max_model_len)


def step_hidden(engine: LLMEngine, rows: int, gate: bool, *, decode: bool = False) -> torch.Tensor:
    """The native step's final hidden states for a chunk of ``rows`` prompt tokens in slot 0
    (``decode``: one token in each of ``rows`` slots), its narrow products (bf16 or int16) on
    when ``gate``."""
    runner = model_runner(engine)
    assert runner.native_step is not None and runner.bf16_gate is not None
    runner.bf16_gate.on = gate
    tokens = [(i * 37) % 4000 + 50 for i in range(rows)]
    if decode:
        return runner.native_step(tokens, [0] * rows, list(range(rows))).clone()
    return runner.native_step(tokens, list(range(rows)), [0] * rows).clone()
