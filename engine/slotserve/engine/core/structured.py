"""Structured output: grammars from JSON schemas, regexes and choices, enforced token by token.

The grammar engine is llguidance (PyPI ``llguidance``, also one of vLLM's backends), chosen over
xgrammar and outlines-core because it compiles nothing ahead: a matcher for a JSON schema is
built in ~0.5 ms (measured here with SmolLM2's 49,152-token vocabulary) and computes each step's
mask lazily, while xgrammar compiles a schema up front and outlines-core builds an index of the
vocabulary per schema (both fine once cached, but a new schema per request is the agent case).
It takes JSON schemas, regexes and Lark grammars, and needs no torch of its own. A request's
grammar is checked when it arrives (off the event loop, with a time limit) and remembered by its
text; each sequence then gets its own matcher, whose mask enters the batched sampling step
(:mod:`slotserve.engine.core.sampling`); the sampled token is fed back to it.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

from slotserve.engine.core.protocols import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared only in the type stub
    from transformers import PreTrainedTokenizerFast

# Grammars checked and kept (by their text): a repeated schema is not checked again.
GRAMMAR_CACHE_SIZE = 256


# A grammar that takes longer than this to check is refused (it would take as long per request).
GRAMMAR_CHECK_SECONDS = 5.0


class GrammarError(ValueError):
    """The grammar engine refuses this schema, regex or choice list (the message says why)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class GrammarTimeoutError(GrammarError):
    """The grammar engine took longer than ``GRAMMAR_CHECK_SECONDS`` to check it."""


async def check_in_time(grammars: Grammars, grammar: str, param: str) -> None:
    """Check ``grammar`` off the event loop within ``GRAMMAR_CHECK_SECONDS``; raises
    :class:`GrammarError` (:class:`GrammarTimeoutError` past the time) naming ``param``."""
    try:
        await asyncio.wait_for(asyncio.to_thread(grammars.check, grammar), GRAMMAR_CHECK_SECONDS)
    except TimeoutError as error:
        raise GrammarTimeoutError(
            f"'{param}' took longer than {GRAMMAR_CHECK_SECONDS:.0f} s to compile", param
        ) from error


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    from llguidance import LLMatcher

    # Compact JSON (vLLM's guidance backend does the same): with free whitespace a weak model can
    # spend every token on blanks between two keys and never finish.
    overrides: JsonCompileOptions = {"whitespace_flexible": False}
    return str(LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=overrides))


def regex_grammar(pattern: str) -> str:
    from llguidance import LLMatcher

    return str(LLMatcher.grammar_from_regex(pattern))


def choice_grammar(choices: list[str]) -> str:
    return regex_grammar("|".join(f"({re.escape(choice)})" for choice in choices))


class Grammars:
    """Checks grammars against one tokenizer and makes matchers; safe on any thread."""

    def __init__(self, tokenizer: Tokenizer, tokenizer_lock: threading.Lock | None = None) -> None:
        self._hf_tokenizer = tokenizer
        # The engine's lock on the HF tokenizer: its loop thread decodes with it meanwhile, and
        # the Rust tokenizer refuses overlapping calls ("Already borrowed").
        self._hf_lock = tokenizer_lock or threading.Lock()
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._checked: OrderedDict[str, None] = OrderedDict()

    @property
    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (built once, ~1 s for a 49k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                # llguidance reads the Rust tokenizer inside a transformers fast tokenizer, which
                # is what the runner loads (AutoTokenizer); anything else fails here, loudly.
                hf_tokenizer = cast("PreTrainedTokenizerFast", self._hf_tokenizer)
                with self._hf_lock:
                    self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Raise :class:`GrammarError` unless the grammar engine accepts ``grammar``."""
        with self._lock:
            if grammar in self._checked:
                self._checked.move_to_end(grammar)
                return
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(str(error))
        with self._lock:
            self._checked[grammar] = None
            while len(self._checked) > GRAMMAR_CACHE_SIZE:
                self._checked.popitem(last=False)

    def matcher(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher
