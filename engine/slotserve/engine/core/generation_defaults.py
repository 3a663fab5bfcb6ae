"""Sampling defaults from the model's ``generation_config.json`` (vLLM's ``--generation-config``).

A request that leaves out ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` or ``max_tokens`` gets the model author's recommendation instead of
OpenAI's defaults (temperature 1.0 makes small instruct models ramble). As in vLLM, only keys the
file sets explicitly count (transformers' class defaults such as ``top_k=50`` do not), a value the
request sends always wins, and ``override_generation_config`` (a JSON object) wins over the file.
One difference: ``"do_sample": false`` means greedy (temperature 0), as in HF ``generate()``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from slotserve.engine.core.params import MaxTokens, MinP, RepetitionPenalty, Temperature, TopK, TopP

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"

# generation_config.json key -> request field (the file says max_new_tokens, requests max_tokens).
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class GenerationDefaults(BaseModel):
    """Request-field defaults; ``None`` leaves OpenAI's own default in place."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    max_tokens: MaxTokens | None = None

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def parse_override(text: str | None) -> dict[str, Any]:
    """The ``override_generation_config`` setting: a JSON object of generation_config keys.

    Raises ValueError (the settings validator turns it into exit status 2) for anything else.
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"override_generation_config is not JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError("override_generation_config must be a JSON object")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"override_generation_config: unknown keys {unknown}; known: {sorted(_KEYS)}"
        )
    _to_defaults(value)  # validates the values
    return value


def load_generation_defaults(
    mode: str, model_source: str, override: str | None = None
) -> GenerationDefaults:
    """Defaults for ``mode``: ``auto`` reads ``generation_config.json`` in the model folder,
    ``none`` keeps OpenAI's defaults, anything else is a folder holding that file."""
    values: dict[str, Any] = {}
    if mode != "none":
        folder = Path(model_source if mode == "auto" else mode).expanduser()
        values = _read_file(folder / GENERATION_CONFIG_FILE)
    values.update(parse_override(override))
    defaults = _to_defaults(values)
    if defaults.as_dict():
        logger.info("sampling defaults from the generation config: %s", defaults.as_dict())
    return defaults


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}  # a hub id or a folder without the file: OpenAI's defaults
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        logger.warning("ignoring %s: %s", path, error)
        return {}
    values: dict[str, Any] = {}
    if raw.get("do_sample") is False:
        # What HF generate() does with this folder: greedy, whatever temperature it names.
        # (vLLM ignores do_sample; a model that says "do not sample" should not be sampled.)
        raw = {**raw, "temperature": 0.0}
    for key in _KEYS:
        if raw.get(key) is None:
            continue
        try:  # one bad value in a model's file must not stop the engine from starting
            _to_defaults({key: raw[key]})
        except ValueError:
            logger.warning("ignoring %s=%r in %s: out of range", key, raw[key], path)
            continue
        values[key] = raw[key]
    return values


def _to_defaults(values: dict[str, Any]) -> GenerationDefaults:
    fields = {_KEYS[key]: value for key, value in values.items()}
    try:
        return GenerationDefaults(**fields)
    except ValidationError as error:
        raise ValueError(f"invalid generation config values {fields}: {error}") from error


def eos_token_ids(model: object, tokenizer: object) -> set[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    for source in (
        getattr(model, "generation_config", None),
        getattr(model, "config", None),
        tokenizer,
    ):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids
