"""Teacher-forced quality of a model against a reference on a fixed text: top-1 agreement and
perplexity (``bench/quant_quality.py`` and ``bench/quant_bench.py`` report them).

A window is fed ``step`` tokens a call, its KV cache carried over: every matrix product has at
most that many rows, as in a decode step, so a quantized model is measured on the kernels that
decode runs; and logits over the vocabulary are held for one step at a time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from bench.lib.kv_simulate import MODES as KV_MODES
from slotserve.contracts.weights import Quantization

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "data" / "quality_text.txt"
# Quality targets: (minimum top-1 agreement, maximum relative perplexity increase). The weight
# formats keep issue 16's bars; bf16 prefill, and anything else that is or would be a default,
# is held to the bar issue 24 sets for any default that is not fp32.
WEIGHT_BARS = {"int8": (0.97, 0.02), "int4": (0.90, 0.08)}
THRESHOLDS = {
    **WEIGHT_BARS, "bf16-prefill": (0.99, 0.005),
    "engine-bf16": (0.99, 0.005), "engine-bf16-prefill": (0.99, 0.005),
    # The fp16 KV cache is a default (where the native kernels run): the same bar.
    "engine-fp32-kv16": (0.99, 0.005), "engine-fp32-kv16-prefill": (0.99, 0.005),
    "engine-bf16-kv16": (0.99, 0.005), "engine-bf16-kv16-prefill": (0.99, 0.005),
    # int16 prefill products are a default (CPUs with AVX512_VNNI, no bf16 units): the same bar.
    **{
        f"engine-int16{kv}{step}": (0.99, 0.005)
        for kv in ("", "-kv16") for step in ("", "-prefill")
    },
    # Simulated KV cache formats (--simulate-kv) would be defaults: the same bar.
    **{f"kv-{mode}": (0.99, 0.005) for mode in KV_MODES},
    # Quantized engines (--engine-quantization) are held to their weights' bars, whatever
    # their products' dtype (bf16 prefill rows over int4 weights: kernels/quantized_bf16.c).
    **{
        f"engine-{q}-{dtype}{kv}{step}": bar
        for q, bar in WEIGHT_BARS.items() for dtype in ("fp32", "bf16") for kv in ("", "-kv16")
        for step in ("", "-prefill")
    },
}  # fmt: skip
# Tokens per forward call (the KV cache carries a window across calls): every matrix product
# sees at most this many rows, as in a decode step of a large batch, so quantized layers run the
# kernels decode runs (a long prefill may take another route). It also bounds the logits held:
# 32 x 49,152 fp32 = 6 MB.
STEP = 32


@dataclass
class Scores:
    """One model's teacher-forced reading of a text: argmax and NLL at every scored position."""

    argmax: torch.Tensor  # int64 [num_predictions]
    nll: torch.Tensor  # float64 [num_predictions]
    num_tokens: int
    window: int
    step: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())


@dataclass
class QualityResult:
    num_tokens: int  # tokens of the text
    num_predictions: int  # positions scored (each window's first token has nothing to predict it)
    window: int
    step: int
    top1_agreement: float
    reference_perplexity: float
    candidate_perplexity: float
    perplexity_increase: float  # candidate / reference - 1
    reference_seconds: float
    candidate_seconds: float

    def passes(self, mode: str) -> bool | None:
        """Whether the issue's thresholds for ``mode`` hold; None when it has none."""
        if mode not in THRESHOLDS:
            return None
        min_agreement, max_increase = THRESHOLDS[mode]
        return self.top1_agreement >= min_agreement and self.perplexity_increase <= max_increase


def text_token_ids(tokenizer, path: Path = DEFAULT_TEXT) -> list[int]:
    """The text at ``path`` as token ids, without special tokens."""
    return list(tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False))


def effective_window(model, window: int) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or window
    return max(2, min(window, limit))


def windows(num_tokens: int, window: int) -> list[tuple[int, int]]:
    """Non-overlapping [start, end) spans covering the text; a last span of 1 token is dropped."""
    spans = [(start, min(start + window, num_tokens)) for start in range(0, num_tokens, window)]
    return [(start, end) for start, end in spans if end - start >= 2]


@torch.inference_mode()
def score(model, token_ids: list[int], window: int = 1024, step: int = STEP) -> Scores:
    """Teacher-forced argmax and NLL of ``model`` at every position of ``token_ids``."""
    window = effective_window(model, window)
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    argmax, nll = [], []
    start_time = time.perf_counter()
    for start, end in windows(len(token_ids), window):
        past = None
        # The window's last token predicts nothing, so it is never fed.
        for first in range(start, end - 1, step):
            last = min(first + step, end - 1)
            out = decoder(input_ids=ids[first:last].unsqueeze(0), past_key_values=past)
            past = out.past_key_values
            logits = head(out.last_hidden_state[0]).float()
            argmax.append(logits.argmax(dim=-1).cpu())
            log_probs = torch.log_softmax(logits, dim=-1)
            picked = log_probs.gather(1, ids[first + 1 : last + 1].unsqueeze(1))
            nll.append(-picked.squeeze(1).double().cpu())
    seconds = time.perf_counter() - start_time
    return Scores(torch.cat(argmax), torch.cat(nll), len(token_ids), window, step, seconds)


def engine_score(engine: Any, token_ids: list[int], window: int, step: int) -> Scores:
    """:func:`score` through a slotserve engine: each window is one request scoring its prompt
    (``prompt_logprobs``), prefilled ``step`` tokens a step (the engine's
    ``max_batched_tokens``), so the products are the engine's own at that many rows, bf16 ones
    included where the runner's ``bf16_scoring`` is on."""
    from slotserve.engine.core.params import SamplingParams

    if engine.settings.max_batched_tokens != step:
        raise ValueError("the engine must take step tokens a step (max_batched_tokens)")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    argmax, nll = [], []
    start_time = time.perf_counter()
    for start, end in windows(len(token_ids), window):
        seq = engine.add_request(f"score-{start}", token_ids[start:end], params)
        while engine.has_unfinished():
            engine.step()
        entries = seq.prompt_logprobs[1:]  # the first token has nothing to predict it
        argmax.append(torch.tensor([entry.top[0][0] for entry in entries]))
        nll.append(torch.tensor([-entry.logprob for entry in entries], dtype=torch.float64))
    seconds = time.perf_counter() - start_time
    return Scores(torch.cat(argmax), torch.cat(nll), len(token_ids), window, step, seconds)


def load_engine(
    source: str,
    dtype: Literal["float32", "bfloat16", "int16"],
    window: int,
    step: int,
    kv_cache_dtype: Literal["float32", "float16"] = "float32",
    quantization: Literal["none", "int8", "int4"] = "none",
) -> tuple[Any, float]:
    """A slotserve engine on ``source`` whose prefill and decode products run in ``dtype``
    (bfloat16, int16 or float32), scoring prompts in that dtype too (the engine scores them in
    fp32), ``step`` tokens a step, its KV cache in ``kv_cache_dtype``; returns it and the load
    seconds; ``quantization`` int8/int4 quantizes its layers (bf16 products then widen the
    weights as they multiply)."""
    from slotserve.engine.core.engine import LLMEngine
    from slotserve.engine.core.model.runner import ModelRunner
    from slotserve.engine.settings import EngineSettings

    start = time.perf_counter()
    settings = EngineSettings(
        model=source, prefill_dtype=dtype, decode_dtype=dtype, max_batch_size=1,
        max_batched_tokens=step, max_model_len=window + 16, enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype, quantization=quantization,
    )  # fmt: skip
    engine = LLMEngine.load(settings)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    runner.bf16_scoring = True
    return engine, time.perf_counter() - start


def compare(reference: Scores, candidate: Scores) -> QualityResult:
    """Agreement and perplexities of two readings of the same tokens."""
    setup = (reference.num_tokens, reference.window, reference.step)
    if setup != (candidate.num_tokens, candidate.window, candidate.step):
        raise ValueError("the two readings scored different tokens, windows or steps")
    ref_ppl, cand_ppl = reference.perplexity, candidate.perplexity
    return QualityResult(
        num_tokens=reference.num_tokens,
        num_predictions=int(reference.argmax.numel()),
        window=reference.window,
        step=reference.step,
        top1_agreement=(reference.argmax == candidate.argmax).double().mean().item(),
        reference_perplexity=ref_ppl,
        candidate_perplexity=cand_ppl,
        perplexity_increase=cand_ppl / ref_ppl - 1.0,
        reference_seconds=reference.seconds,
        candidate_seconds=candidate.seconds,
    )


def evaluate(
    reference, candidate, token_ids: list[int], window: int = 1024, step: int = STEP
) -> QualityResult:
    """Top-1 agreement and perplexities of ``candidate`` against ``reference`` on the tokens."""
    window = min(effective_window(reference, window), effective_window(candidate, window))
    return compare(
        score(reference, token_ids, window, step), score(candidate, token_ids, window, step)
    )


def load_quantized(source: str, mode: Quantization) -> tuple[Any, object | None, float]:
    """A fresh fp32 CPU copy of ``source``, quantized in place unless ``mode`` is ``none``.

    Returns the model, the QuantizationReport (None for ``none``) and the load+quantize seconds.
    """
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    report = None
    if mode != "none":
        from slotserve.engine.core.kernels import load_kernels
        from slotserve.engine.core.model.quantize import quantize_model
        from slotserve.settings import CommonSettings

        report = quantize_model(model, mode, load_kernels(CommonSettings().home))
    return model, report, time.perf_counter() - start


class Bf16Products(torch.nn.Module):
    """A linear layer computed as the engine's bf16 prefill computes it (bf16_prefill.py):
    inputs and weights rounded to bf16, one bf16 GEMM accumulated in fp32, bias in fp32."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight_bf16 = linear.weight.detach().to(torch.bfloat16)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight_bf16).float()
        return out if self.bias is None else out + self.bias


def load_bf16_prefill(source: str) -> tuple[Any, float]:
    """A fresh fp32 copy of ``source`` whose decoder products run as bf16 prefill runs them
    (the output projection stays fp32, as in the engine); returns it and the load seconds."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    decoder = model.get_decoder()
    for module in list(decoder.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, child_name, Bf16Products(child))
    return model, time.perf_counter() - start
