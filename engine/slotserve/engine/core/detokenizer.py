"""Incremental detokenization with stop strings: text deltas that are safe to send; and the
texts of single tokens, for logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from slotserve.engine.core.logprobs import (
    PromptLogprob,
    PromptTokenLogprobs,
    SampledLogprobs,
    TokenLogprobs,
    finite,
)
from slotserve.engine.core.protocols import Tokenizer
from slotserve.engine.core.stops import StopStringFilter

# Tokens of prompt context decoded with the output, so a first token that starts with a
# word-joining piece (SentencePiece's leading space, a UTF-8 continuation) decodes as it would
# in place.
NUM_CONTEXT_TOKENS = 4


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string matched: the text ends just before it


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of recent tokens twice (with and without the newest) and emits the
    difference, as vLLM and TGI do; a window that ends inside a multi-byte character (U+FFFD)
    waits for the next token. With stop strings, text that could still become a stop string is
    held back until it cannot, and a matched stop string is cut off with everything after it
    (:class:`~slotserve.engine.core.stops.StopStringFilter`: per token O(longest stop string), never
    O(output)).
    """

    tokenizer: Tokenizer
    prompt_token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    token_ids: list[int] = field(init=False)
    _stops: StopStringFilter = field(init=False)
    _prefix_offset: int = field(init=False)
    _read_offset: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._stops = StopStringFilter(self.stop)
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)

    def add_tokens(self, new_token_ids: list[int], *, final: bool = False) -> TextDelta:
        """Append tokens; returns the text now safe to emit (all of it when ``final``)."""
        pieces = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            pieces.append(self._decode_newest())
        filtered = self._stops.add("".join(pieces), final=final)
        return TextDelta(filtered.text, stopped=filtered.stopped)

    def _decode_newest(self) -> str:
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = decode(self.token_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for more bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full[len(prefix) :]


class TokenTexts:
    """Token id -> its text, cached (called under the engine's tokenizer lock)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text

    def decode(self, sampled: SampledLogprobs) -> TokenLogprobs:
        return TokenLogprobs(
            token=self(sampled.token_id),
            logprob=finite(sampled.logprob),
            top=tuple((self(token_id), finite(lp)) for token_id, lp in sampled.top),
        )

    def decode_prompt(self, entry: PromptLogprob) -> PromptTokenLogprobs:
        return PromptTokenLogprobs(
            token=self(entry.token_id),
            logprob=finite(entry.logprob),
            top=tuple((self(token_id), finite(lp)) for token_id, lp in entry.top),
            token_id=entry.token_id,
            rank=entry.rank,
            top_ids=tuple(token_id for token_id, _ in entry.top),
        )
