"""Tiny randomly initialised Llama models, so engine tests run in seconds on a CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def build_tiny_model(
    dest: Path,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a random Llama (with ``tokenizer_dir``'s tokenizer and chat template) to ``dest``.

    The weights are random but fixed by ``seed``, so greedy outputs are deterministic and
    comparable between runs of the engine and of Hugging Face ``generate()``.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform logits, where greedy choices hinge on float noise; a
    # larger spread makes the argmax robust so equivalence tests compare real decisions.
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(dest), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, dest / name)
    return dest
