"""``slotserve generate``: one chat answer from a model, locally, without a server."""

from __future__ import annotations

import argparse
import sys
from typing import cast

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from slotserve.models.resolve import ModelNotFoundError, resolve_model
from slotserve.settings import CommonSettings, settings_from_args


class GenerateSettings(BaseSettings):
    """Flags of ``slotserve generate`` (env prefix ``SLOTSERVE_GENERATE_``)."""

    model_config = SettingsConfigDict(env_prefix="SLOTSERVE_GENERATE_", extra="ignore")

    model: str = "smollm2"
    max_tokens: int = Field(128, ge=1, le=8192)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    system: str | None = None


def main(argv: list[str]) -> int:
    """Entry point of ``slotserve generate``."""
    parser = argparse.ArgumentParser(prog="slotserve generate", description=__doc__)
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--model", default=None, help="known name, local HF folder or hub id")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 128")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling, default 1")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling")
    parser.add_argument("--system", default=None, help="system message")
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(GenerateSettings, args)
        source = resolve_model(settings.model, home=CommonSettings().home, show_progress=True)
    except (ValidationError, ModelNotFoundError) as exc:
        print(f"slotserve generate: {exc}", file=sys.stderr)
        return 2
    print(generate_answer(source, args.prompt, settings))
    return 0


def generate_answer(source: str, prompt: str, settings: GenerateSettings) -> str:
    """Apply the chat template to ``prompt`` and decode the model's answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.eval()
    messages = [{"role": "user", "content": prompt}]
    if settings.system is not None:
        messages.insert(0, {"role": "system", "content": settings.system})
    # With return_dict and return_tensors="pt" the result is a BatchEncoding of tensors; the
    # declared return type is the union over every combination of flags.
    encoded = cast(
        BatchEncoding,
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        ),
    )
    input_ids: torch.Tensor = encoded["input_ids"]
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    sampling = settings.temperature > 0
    with torch.inference_mode():
        # transformers types from_pretrained's result as a class that does not match
        # generate's own self-type protocol, though the loaded model is both.
        output = model.generate(  # type: ignore[misc]
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=settings.max_tokens,
            do_sample=sampling,
            temperature=settings.temperature if sampling else None,
            top_p=settings.top_p if sampling else None,
            top_k=None,
            pad_token_id=tokenizer.pad_token_id,
        )
    # One sequence of ids decodes to one string (only a batch decodes to a list).
    answer = cast(str, tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True))
    return answer.strip()
