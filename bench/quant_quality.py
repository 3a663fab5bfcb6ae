"""Quantization quality: a candidate model vs the fp32 reference, teacher-forced on a fixed text.

    .venv/bin/python bench/quant_quality.py --model smollm2 --quantization int8 int4

The text (``bench/data/quality_text.txt``, public domain) is tokenized once and cut into windows
of at most ``--window`` tokens (and the model's positions). Both models read every window with a
plain Hugging Face forward pass (no engine), and at each position:

- top-1 agreement: the candidate's argmax equals the reference's;
- perplexity: exp of the mean negative log-likelihood of the text's next token, per model.

A window is fed ``--step`` tokens a call, its KV cache carried over: every matrix product has at
most that many rows, as in a decode step, so a quantized model is measured on the kernels that
decode runs; and logits over the vocabulary (49,152 for SmolLM2) are held for one step at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from slotserve.engine.core.openmp import openmp_environment

os.environ.update(openmp_environment())  # libgomp reads it when torch loads

import torch
from rich.console import Console
from rich.table import Table

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "quality_text.txt"
# Issue 16's quality targets: (minimum top-1 agreement, maximum relative perplexity increase).
THRESHOLDS = {"int8": (0.97, 0.02), "int4": (0.90, 0.08)}
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


def load_quantized(source: str, mode: str) -> tuple[object, object | None, float]:
    """A fresh fp32 CPU copy of ``source``, quantized in place unless ``mode`` is ``none``.

    Returns the model, the QuantizationReport (None for ``none``) and the load+quantize seconds.
    """
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    report = None
    if mode != "none":
        from slotserve.engine.core.quantize import quantize_model

        report = quantize_model(model, mode)
    return model, report, time.perf_counter() - start


def quality_table(rows: dict[str, QualityResult]) -> Table:
    table = Table(title="quantization quality vs fp32, teacher-forced")
    for col in ("mode", "top-1 agreement", "ppl fp32", "ppl mode", "ppl increase", "target"):
        table.add_column(col, justify="right")
    for mode, result in rows.items():
        verdict = result.passes(mode)
        target = "-"
        if verdict is not None:
            min_agreement, max_increase = THRESHOLDS[mode]
            mark = "[green]pass[/]" if verdict else "[red]FAIL[/]"
            target = f"≥{min_agreement:.0%}, ≤{max_increase:.0%}: {mark}"
        table.add_row(
            mode,
            f"{result.top1_agreement:.2%}",
            f"{result.reference_perplexity:.5g}",
            f"{result.candidate_perplexity:.5g}",
            f"{result.perplexity_increase:+.2%}",
            target,
        )
    return table


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slotserve.models.resolve import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="name, folder or hub id")
    parser.add_argument("--quantization", nargs="+", default=["int8", "int4"])
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--step", type=int, default=STEP, help="tokens per forward call")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path("results/quant_quality.json"))
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    token_ids = text_token_ids(tokenizer, args.text)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    window = effective_window(reference, args.window)
    print(f"{len(token_ids)} tokens of {args.text}, windows of {window}, {args.step} a call")
    ref_scores = score(reference, token_ids, window, args.step)
    rows: dict[str, QualityResult] = {}
    for mode in args.quantization:
        candidate, _, seconds = load_quantized(source, mode)
        rows[mode] = compare(ref_scores, score(candidate, token_ids, window, args.step))
        print(f"  {mode}: loaded and quantized in {seconds:.1f} s")
        del candidate
    Console(width=120).print(quality_table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "text": str(args.text), "quality": rows}
    args.out.write_text(json.dumps(report, indent=2, default=asdict))
    print(f"wrote {args.out}")
    return 0 if all(r.passes(m) is not False for m, r in rows.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
