"""Tool calls: the request's tools through the chat template, and the model's calls parsed back.

A model family writes its calls in its own format, and a parser reads them back (vLLM's names):

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, possibly after some text.
- ``llama3_json`` (Llama 3.1/3.2): the whole answer is ``{"name": ..., "parameters": {...}}``
  (several calls separated by ``;``).

``--tool-call-parser auto`` picks one from the chat template's text (hermes unless the template
is Llama 3's). A template that does not render tools itself (SmolLM2's ignores them) gets them
the way Qwen's template writes them: described in the system turn, earlier calls written in the
parser's format, tool results as user turns.

``tool_choice`` ``required`` and a named function constrain the answer with the grammar engine
(:mod:`slotserve.engine.core.structured`) to exactly one call in the parser's format whose arguments
match the tool's ``parameters`` schema, so the call parses even from a random model; ``auto``
parses what the model wrote (text that is not a well-formed call stays content); ``none``
renders no tools and parses nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slotserve.engine.core.errors import InvalidRequestError
from slotserve.engine.core.structured import GRAMMAR_CHECK_SECONDS, Grammars, json_schema_grammar

ToolParserName = Literal["auto", "hermes", "llama3_json"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # always strict here when the grammar is used


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


class ToolCall(_Strict):
    """An assistant's call, in requests (earlier turns) and in responses."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _is_none(value: object) -> bool:
    return value is None


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, exclude_if=_is_none)
    arguments: str


class ToolCallDelta(BaseModel):
    """A streamed call, as OpenAI sends one: first its id, type and name (arguments ""), then
    its arguments (here in one piece, known only once the call has parsed)."""

    index: int
    id: str | None = Field(None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(None, exclude_if=_is_none)
    function: FunctionCallDelta

    @classmethod
    def of(cls, index: int, call: ToolCall) -> list[ToolCallDelta]:
        head = FunctionCallDelta(name=call.function.name, arguments="")
        return [
            cls(index=index, id=call.id, type="function", function=head),
            cls(index=index, function=FunctionCallDelta(arguments=call.function.arguments)),
        ]


class ToolError(InvalidRequestError):
    """The request's tools or tool_choice cannot be served (400 naming the field)."""


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: Any

    def to_tool_call(self) -> ToolCall:
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return ToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            function=FunctionCall(name=self.name, arguments=arguments),
        )


# ---------------------------------------------------------------------------------------------
# Parsers


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


# ---------------------------------------------------------------------------------------------
# One request's tools


@dataclass
class ToolPlan:
    """What one chat request does with tools: render them, constrain the answer, parse it."""

    parser: ToolParser
    tools: list[Tool] = field(default_factory=list)
    choice: Literal["none", "auto", "required", "named"] = "none"
    named: str | None = None
    template_knows_tools: bool = True

    @property
    def parses(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def grammar(self) -> tuple[str, str] | None:
        """``(param, grammar)`` for ``required`` and a named choice: exactly one call."""
        if self.choice not in ("required", "named"):
            return None
        functions = [
            (tool.function.name, tool.function.parameters or {"type": "object"})
            for tool in self.tools
            if self.choice == "required" or tool.function.name == self.named
        ]
        return "tool_choice", self.parser.grammar(functions)

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def template_input(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """``(messages, tools)`` for ``apply_chat_template``: as they are for a template that
        renders tools, else rewritten into plain turns (module docstring)."""
        shown = self.tool_dicts() if self.parses else None
        if self.template_knows_tools:
            return messages, shown
        plain = [self._plain(message) for message in messages]
        if shown:
            prompt = self.parser.system_prompt(shown)
            if plain[0]["role"] == "system":
                plain[0] = {"role": "system", "content": plain[0]["content"] + "\n\n" + prompt}
            else:
                plain.insert(0, {"role": "system", "content": prompt})
        return plain, None

    def _plain(self, message: dict[str, Any]) -> dict[str, Any]:
        if message["role"] == "tool":
            return {
                "role": "user",
                "content": f"<tool_response>\n{message['content']}\n</tool_response>",
            }
        calls = message.get("tool_calls")
        if not calls:
            return {"role": message["role"], "content": message["content"]}
        rendered = [
            self.parser.render_call(c["function"]["name"], c["function"]["arguments"])
            for c in calls
        ]
        text = "\n".join(filter(None, [message["content"], *rendered]))
        return {"role": message["role"], "content": text}


def plan_tools(body: Any, setting: ToolParserName, chat_template: Any) -> ToolPlan:
    """Check a chat request's ``tools`` and ``tool_choice``; :class:`ToolError` names the field."""
    tools: list[Tool] = body.tools or []
    choice = body.tool_choice
    names = [tool.function.name for tool in tools]
    for index, tool in enumerate(tools):
        if names.index(tool.function.name) != index:
            raise ToolError(
                f"tool names must be unique; '{tool.function.name}' appears twice",
                param=f"tools.{index}.function.name",
            )
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ToolError(
                "a function's 'parameters' must be a JSON schema of type object",
                param=f"tools.{index}.function.parameters",
            )
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's default
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in names:
            raise ToolError(
                f"'tool_choice' names the function '{named}', which is not in 'tools'",
                param="tool_choice",
            )
        choice = "named"
    elif choice == "required" and not tools:
        raise ToolError("'tool_choice' 'required' needs at least one tool", param="tool_choice")
    template = chat_template if isinstance(chat_template, str) else ""
    return ToolPlan(
        parser=choose_parser(setting, chat_template),
        tools=tools,
        choice=choice,
        named=named,
        template_knows_tools="tools" in template,
    )


async def check_tool_schemas(grammars: Grammars, plan: ToolPlan) -> None:
    """Every tool's parameters schema, checked by the grammar engine off the event loop (cached
    by text, so a repeated tool list costs nothing)."""
    for index, tool in enumerate(plan.tools):
        if tool.function.parameters is None:
            continue
        param = f"tools.{index}.function.parameters"
        try:
            grammar = json_schema_grammar(tool.function.parameters)
            await asyncio.wait_for(
                asyncio.to_thread(grammars.check, grammar), GRAMMAR_CHECK_SECONDS
            )
        except TimeoutError as error:
            raise ToolError(
                f"'{param}' took longer than {GRAMMAR_CHECK_SECONDS:.0f} s to compile", param
            ) from error
        except Exception as error:  # GrammarError or the library's own: the request's fault
            raise ToolError(f"'{param}' is not a usable JSON schema: {error}", param) from error
