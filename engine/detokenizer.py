"""Incremental detokenization with stop strings: text deltas that are safe to send."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    held back until it cannot, and a matched stop string is cut off with everything after it.
    """

    tokenizer: Any
    prompt_token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    token_ids: list[int] = field(init=False)
    output_text: str = field(init=False, default="")  # all decoded text so far
    num_emitted_chars: int = field(init=False, default=0)
    _prefix_offset: int = field(init=False)
    _read_offset: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)

    def add_tokens(self, new_token_ids: list[int], *, final: bool = False) -> TextDelta:
        """Append tokens; returns the text now safe to emit (all of it when ``final``)."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.output_text += self._decode_newest()
        stop_at = self._find_stop()
        if stop_at is not None:
            self.output_text = self.output_text[:stop_at]
            return TextDelta(self._emit(len(self.output_text)), stopped=True)
        if final:
            return TextDelta(self._emit(len(self.output_text)), stopped=False)
        return TextDelta(self._emit(len(self.output_text) - self._held_back()), stopped=False)

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

    def _find_stop(self) -> int | None:
        if not self.stop:
            return None
        # Only text not yet emitted can hold a new match (emitted text held no stop's start).
        window_start = self.num_emitted_chars
        found = [
            index
            for stop in self.stop
            if (index := self.output_text.find(stop, window_start)) != -1
        ]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.output_text)), longest, -1):
                if self.output_text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.num_emitted_chars)
        text = self.output_text[self.num_emitted_chars : upto]
        self.num_emitted_chars = upto
        return text
