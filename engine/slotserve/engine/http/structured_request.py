"""A request body's structured-output fields as the one grammar its answer must match.

OpenAI's ``response_format`` (json_object, json_schema) and vLLM's ``guided_json``,
``guided_regex`` and ``guided_choice`` each become a grammar of the grammar engine
(:mod:`slotserve.engine.core.structured`); a tool call's grammar (``tool_calls.py``) is one more
source. At most one may be given, and none with ``ignore_eos`` or ``min_tokens``. Which field
applies is decided on the event loop (cheap); building the grammar from it and compiling it run
in a thread, within the grammar time limit.
"""

from __future__ import annotations

from collections.abc import Callable

from slotserve.engine.core.structured import (
    CompiledGrammar,
    GrammarError,
    Grammars,
    GrammarTimeoutError,
    check_in_time,
    choice_grammar,
    json_schema_grammar,
    regex_grammar,
)
from slotserve.engine.http.openai_api import ChatCompletionRequest, SamplingRequest


def grammar_source(
    body: SamplingRequest, tool_grammar: tuple[str, str] | None = None
) -> tuple[str, Callable[[], str]] | None:
    """``(param, build)`` for the body's structured-output field or ``tool_grammar``, if any:
    ``build()`` makes the grammar text (blocking on large schemas: call it off the loop)."""
    sources: list[tuple[str, Callable[[], str]]] = []
    if tool_grammar is not None:
        sources.append((tool_grammar[0], lambda: tool_grammar[1]))
    response_format = body.response_format if isinstance(body, ChatCompletionRequest) else None
    if response_format is not None and response_format.type == "json_object":
        sources.append(("response_format", lambda: json_schema_grammar({"type": "object"})))
    if (
        response_format is not None
        and response_format.type == "json_schema"
        and response_format.json_schema is not None
    ):
        schema = response_format.json_schema.schema_ or {}
        sources.append(("response_format.json_schema", lambda: json_schema_grammar(schema)))
    if (guided_json := body.guided_json) is not None:
        sources.append(("guided_json", lambda: json_schema_grammar(guided_json)))
    if (guided_regex := body.guided_regex) is not None:
        sources.append(("guided_regex", lambda: regex_grammar(guided_regex)))
    if (guided_choice := body.guided_choice) is not None:
        sources.append(("guided_choice", lambda: choice_grammar(guided_choice)))
    if not sources:
        return None
    if len(sources) > 1:
        raise GrammarError(
            f"'{sources[1][0]}' cannot be combined with '{sources[0][0]}'", sources[1][0]
        )
    for field, value in (("ignore_eos", body.ignore_eos), ("min_tokens", body.min_tokens)):
        if value:
            raise GrammarError(f"'{field}' cannot be combined with structured output", field)
    return sources[0]


def _built(param: str, build: Callable[[], str]) -> str:
    try:
        return build()
    except Exception as error:  # the library's own error types: the request's fault
        raise GrammarError(f"'{param}' is not usable: {error}", param) from error


async def check_requested_grammar(
    grammars: Grammars, body: SamplingRequest, tool_grammar: tuple[str, str] | None = None
) -> CompiledGrammar | None:
    """The request's grammar, built and compiled off the event loop in time (see
    ``check_in_time``): the engine clones its matcher for every choice."""
    source = grammar_source(body, tool_grammar)
    if source is None:
        return None
    param, build = source
    try:
        return await check_in_time(grammars, lambda: _built(param, build), param)
    except GrammarTimeoutError:
        raise
    except GrammarError as error:
        if error.param == param:  # _built's own: it names the field already
            raise
        raise GrammarError(f"'{param}' is not usable: {error}", param) from error
