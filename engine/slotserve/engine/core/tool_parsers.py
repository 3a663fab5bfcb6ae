"""Tool-call formats: how a model family writes its calls, parsed back (vLLM's parser names).

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, possibly after some text.
- ``llama3_json`` (Llama 3.1/3.2): the whole answer is ``{"name": ..., "parameters": {...}}``
  (several calls separated by ``;``).

``--tool-call-parser auto`` picks one from the chat template's text (hermes unless the template
is Llama 3's). Each parser also writes the grammar that constrains an answer to exactly one call
and the system prompt that describes tools to a template that does not render them itself. The
OpenAI side (request tools, ``tool_choice``, response calls) is
:mod:`slotserve.engine.http.tool_calls`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

ToolParserName = Literal["auto", "hermes", "llama3_json"]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: Any


class ToolParser:
    """One model family's call format: parse it, find where it may start, constrain it."""

    name: str
    # How a call names its arguments object in this format.
    arguments_key: str

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """``(content, calls)``; no calls (and all the text as content) unless it parses."""
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        """Where a call may begin in ``text`` (its length if none can): a stream sends the text
        before it as content and holds the rest until it knows."""
        raise NotImplementedError

    # The grammar's start rule: the text around one call.
    grammar_start: str

    def grammar(self, functions: list[tuple[str, dict[str, Any]]]) -> str:
        """A grammar for exactly one call of one of ``functions`` (name, parameters schema).

        The call's JSON is spelled out here and each parameters schema is the root of its own
        ``%json`` rule, so its ``$ref``s into its own ``$defs`` (pydantic's schemas) resolve.
        """
        alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
        lines = ["%llguidance {}", self.grammar_start, f"call: {alternatives}"]
        for i, (name, schema) in enumerate(functions):
            head = json.dumps(f'{{"name": {json.dumps(name)}, "{self.arguments_key}": ')
            lines.append(f'call_{i}: {head} arguments_{i} "}}"')
            lines.append(f"arguments_{i}: %json {_compact(schema)}")
        return "\n".join(lines) + "\n"

    def render_call(self, name: str, arguments: Any) -> str:
        raise NotImplementedError

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        raise NotImplementedError


def _call_from(value: Any, keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in keys:
        if isinstance(value.get(key), dict):
            return ParsedCall(value["name"], value[key])
    return None


def _compact(schema: dict[str, Any]) -> str:
    # Compact JSON, as structured.json_schema_grammar does: free whitespace lets a weak model
    # spend every token on blanks.
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


class HermesParser(ToolParser):
    name = "hermes"
    arguments_key = "arguments"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text[start:]):
            try:
                call = _call_from(json.loads(block), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return text, []  # a malformed block: the model wrote text, not a call
            calls.append(call)
        return text[:start], calls

    def hold_from(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        for size in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-size:]):
                return len(text) - size  # may be the tag's beginning
        return len(text)

    grammar_start = 'start: "<tool_call>\\n" call "\\n</tool_call>"'

    def render_call(self, name: str, arguments: Any) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        # Qwen 2.5's own wording (its template renders tools this way).
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                value, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call_from(value, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            while pos < len(body) and body[pos] in "; \t\n":
                pos += 1
        return "", calls

    def hold_from(self, text: str) -> int:
        head = text.lstrip()
        if head.startswith(("{", self.PYTHON_TAG)) or self.PYTHON_TAG.startswith(head):
            return 0  # the answer may be a call: this format has no text before one
        return len(text)

    grammar_start = "start: call"

    def render_call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        # Llama 3.1's wording for JSON-based tool calling.
        listed = "\n\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n" + listed
        )


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


def choose_parser(setting: ToolParserName, chat_template: Any) -> ToolParser:
    """The flag's parser, or for ``auto`` the one the chat template's text shows."""
    if setting != "auto":
        return PARSERS[setting]
    template = chat_template if isinstance(chat_template, str) else ""
    if "<tool_call>" not in template and (
        "<|python_tag|>" in template or '"parameters": ' in template
    ):
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]
