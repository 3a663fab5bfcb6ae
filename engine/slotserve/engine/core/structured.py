"""Structured output: grammars from JSON schemas, regexes and choices, enforced token by token.

The grammar engine is llguidance (PyPI ``llguidance``, also one of vLLM's backends), chosen over
xgrammar and outlines-core because it compiles nothing ahead: a matcher for a JSON schema is
built in ~0.5 ms (measured here with SmolLM2's 49,152-token vocabulary) and computes each step's
mask lazily, while xgrammar compiles a schema up front and outlines-core builds an index of the
vocabulary per schema (both fine once cached, but a new schema per request is the agent case).
It takes JSON schemas, regexes and Lark grammars, and needs no torch of its own.

The event loop never waits on the grammar engine: a request's grammar is built from its schema
and compiled once, in a thread within ``GRAMMAR_CHECK_SECONDS``, into a :class:`CompiledGrammar`
(the text carrying its compiled matcher); each sequence, one per choice, gets a clone of that
matcher (~0.1 ms, where compiling a 1 MB grammar takes 0.1-0.5 s), whose mask enters the batched
sampling step (:mod:`slotserve.engine.core.model.sampling`); the sampled token is fed back to it.
Grammar text beyond ``MAX_GRAMMAR_CHARS`` is refused before any of that. Compiled grammars are
remembered by their text (a repeated schema is not compiled again), within a bound on their total
size.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from slotserve.engine.core.protocols import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared only in the type stub
    from transformers import PreTrainedTokenizerFast

# Compiled grammars kept by their text: at most this many, and at most this many characters of
# grammar text in all (a compiled matcher takes ~17 bytes per character of its grammar: 3.7 MB for
# a 220,000-character enum), so the cache stays under ~70 MB whatever the requests.
GRAMMAR_CACHE_SIZE = 256
GRAMMAR_CACHE_CHARS = 4 * 2**20

# A grammar that takes longer than this to build and compile is refused (it would take as long
# per request).
GRAMMAR_CHECK_SECONDS = 5.0

# Longest grammar text (or schema, regex, choice list it is built from) a request may bring, in
# characters: compiling costs ~0.4 s per million characters and ~17 bytes of memory per
# character; 256 Ki characters hold a JSON schema with ~11,000 enum values or large tool lists.
MAX_GRAMMAR_CHARS = 262_144


class GrammarError(ValueError):
    """The grammar engine refuses this schema, regex or choice list (the message says why)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class GrammarTimeoutError(GrammarError):
    """The grammar engine took longer than ``GRAMMAR_CHECK_SECONDS`` to compile it."""


class GrammarTooLargeError(GrammarError):
    """The grammar (or what it is built from) is longer than ``MAX_GRAMMAR_CHARS``."""


def check_grammar_size(text: str, what: str = "the grammar") -> None:
    """Raise :class:`GrammarTooLargeError` when ``text`` exceeds ``MAX_GRAMMAR_CHARS``."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLargeError(
            f"{what} has {len(text):,} characters; this engine takes at most {MAX_GRAMMAR_CHARS:,}"
        )


class CompiledGrammar(str):
    """A grammar's text carrying its compiled matcher, a prototype never fed a token.

    It goes wherever the text goes (``SamplingParams.grammar``), so the engine thread clones the
    prototype for each sequence instead of compiling the grammar again on its way.
    """

    prototype: Any

    def __new__(cls, text: str, prototype: Any) -> CompiledGrammar:
        compiled = super().__new__(cls, text)
        compiled.prototype = prototype
        return compiled


async def check_in_time(
    grammars: Grammars, grammar: str | Callable[[], str], param: str
) -> CompiledGrammar:
    """Build (when given a builder) and compile ``grammar`` off the event loop within
    ``GRAMMAR_CHECK_SECONDS``; raises :class:`GrammarError` (:class:`GrammarTimeoutError` past
    the time) naming ``param``."""
    build = grammar if callable(grammar) else lambda: grammar

    def compile_built() -> CompiledGrammar:
        return grammars.compile(build())

    try:
        return await asyncio.wait_for(asyncio.to_thread(compile_built), GRAMMAR_CHECK_SECONDS)
    except TimeoutError as error:
        raise GrammarTimeoutError(
            f"'{param}' took longer than {GRAMMAR_CHECK_SECONDS:.0f} s to compile", param
        ) from error


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    from llguidance import LLMatcher

    # Compact JSON (vLLM's guidance backend does the same): with free whitespace a weak model can
    # spend every token on blanks between two keys and never finish.
    overrides: JsonCompileOptions = {"whitespace_flexible": False}
    text = json.dumps(schema)
    check_grammar_size(text, "the JSON schema")
    return str(LLMatcher.grammar_from_json_schema(text, overrides=overrides))


def regex_grammar(pattern: str) -> str:
    from llguidance import LLMatcher

    check_grammar_size(pattern, "the regex")
    return str(LLMatcher.grammar_from_regex(pattern))


def choice_grammar(choices: list[str]) -> str:
    return regex_grammar("|".join(f"({re.escape(choice)})" for choice in choices))


class Grammars:
    """Compiles grammars against one tokenizer and makes matchers; safe on any thread."""

    def __init__(self, tokenizer: Tokenizer, tokenizer_lock: threading.Lock | None = None) -> None:
        self._hf_tokenizer = tokenizer
        # The engine's lock on the HF tokenizer: its loop thread decodes with it meanwhile, and
        # the Rust tokenizer refuses overlapping calls ("Already borrowed").
        self._hf_lock = tokenizer_lock or threading.Lock()
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._num_cached_chars = 0

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

    def compile(self, grammar: str) -> CompiledGrammar:
        """``grammar`` with its compiled matcher (blocking: 0.1-0.5 s for a large grammar, so
        call it off the event loop); raises :class:`GrammarError` if the engine refuses it."""
        check_grammar_size(grammar)
        with self._lock:
            prototype = self._compiled.get(grammar)
            if prototype is not None:
                self._compiled.move_to_end(grammar)
                return CompiledGrammar(grammar, prototype)
        from llguidance import LLMatcher

        prototype = LLMatcher(self.tokenizer, grammar)
        if prototype.is_error():
            raise GrammarError(prototype.get_error())
        with self._lock:
            if grammar not in self._compiled:
                self._compiled[grammar] = prototype
                self._num_cached_chars += len(grammar)
            while (
                len(self._compiled) > GRAMMAR_CACHE_SIZE
                or self._num_cached_chars > GRAMMAR_CACHE_CHARS
            ):
                text, _ = self._compiled.popitem(last=False)
                self._num_cached_chars -= len(text)
        return CompiledGrammar(grammar, prototype)

    def check(self, grammar: str) -> None:
        """Raise :class:`GrammarError` unless the grammar engine accepts ``grammar``."""
        self.compile(grammar)

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher for one sequence: a clone of the compiled prototype, so a
        :class:`CompiledGrammar` (every HTTP request's) is never compiled here."""
        compiled = grammar if isinstance(grammar, CompiledGrammar) else self.compile(grammar)
        return compiled.prototype.deep_copy()
