"""Tool calls, the OpenAI side: the request's tools and ``tool_choice``, checked and planned
through the chat template, and the calls a response carries.

The model's own call format (hermes, llama3_json) is read and written by a parser from
:mod:`slotserve.engine.core.tool_parsers`. A template that does not render tools itself (SmolLM2's
ignores them) gets them the way Qwen's template writes them: described in the system turn,
earlier calls written in the parser's format, tool results as user turns.

``tool_choice`` ``required`` and a named function constrain the answer with the grammar engine
(:mod:`slotserve.engine.core.structured`) to exactly one call in the parser's format whose arguments
match the tool's ``parameters`` schema, so the call parses even from a random model; ``auto``
parses what the model wrote (text that is not a well-formed call stays content); ``none``
renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slotserve.engine.core.errors import InvalidRequestError
from slotserve.engine.core.structured import (
    Grammars,
    GrammarTimeoutError,
    check_in_time,
    json_schema_grammar,
)
from slotserve.engine.core.tool_parsers import ParsedCall, ToolParser, ToolParserName, choose_parser


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

    @classmethod
    def from_parsed(cls, call: ParsedCall) -> ToolCall:
        """A parsed call as a response carries it, under a fresh id."""
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        return cls(
            id=f"call_{uuid.uuid4().hex[:24]}",
            function=FunctionCall(name=call.name, arguments=arguments),
        )


def _is_none(value: object) -> bool:
    return value is None


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=_is_none)
    arguments: str


class ToolCallDelta(BaseModel):
    """A streamed call, as OpenAI sends one: first its id, type and name (arguments ""), then
    its arguments (here in one piece, known only once the call has parsed)."""

    index: int
    id: str | None = Field(default=None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
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
            await check_in_time(grammars, grammar, param)
        except GrammarTimeoutError as error:
            raise ToolError(str(error), param) from error
        except Exception as error:  # GrammarError or the library's own: the request's fault
            raise ToolError(f"'{param}' is not a usable JSON schema: {error}", param) from error
