"""OpenAI's Responses API (``POST /v1/responses``), stateless: the request body and its
translation into a chat request.

What is served: ``input`` as text or as a list of items (messages with text parts, earlier
``function_call`` items and their ``function_call_output``), ``instructions``,
``max_output_tokens``, ``temperature`` and ``top_p``, function ``tools`` with ``tool_choice``
and ``parallel_tool_calls``, ``text.format`` (text, JSON object, JSON schema), ``metadata`` and
streaming. Nothing is stored: ``store`` must be false or left out, and ``previous_response_id``
and ``conversation`` (which need stored responses) are refused with a 400 that says so, as are
every other field this server cannot honour (images, files, hosted tools, reasoning, logprobs),
each named.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from slotserve.engine.core.params import MaxTokens, Temperature, TopP
from slotserve.engine.http.openai_api import ChatCompletionRequest, RequestModel


def _refuse(why: str) -> Any:
    """A field validator: any value but null is refused with ``why``."""

    def check(cls: Any, value: Any) -> Any:
        if value is not None:
            raise ValueError(why)
        return value

    return classmethod(check)


# -- input items ------------------------------------------------------------------------------


class InputText(RequestModel):
    type: Literal["input_text"]
    text: str


class OutputText(RequestModel):
    """An earlier answer's text, as a client sends its previous output back."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list, max_length=0)
    logprobs: list[Any] | None = None


class Refusal(RequestModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(RequestModel):
    """A message: the easy form (``{"role", "content"}``) or the item form (``type``,
    ``id``, ``status`` as the API returned them)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(
            part.refusal if isinstance(part, Refusal) else part.text for part in self.content
        )


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError("'arguments' must be a JSON object as a string")
        return value


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")
]


def _item_type(value: Any) -> Any:
    # The easy message form has no "type": default it, so one discriminator reads every item.
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return {**value, "type": "message"}
    return value


# -- tools and formats ------------------------------------------------------------------------


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        has_schema = self.schema_ is not None and self.name is not None
        if has_schema != (self.type == "json_schema"):
            raise ValueError(
                "'name' and 'schema' are required with type json_schema, and only then"
            )
        return self


class TextOptions(RequestModel):
    format: TextFormat | None = None
    verbosity: None = None  # a reasoning models' setting: refused


# -- the request ------------------------------------------------------------------------------


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``: see the module docstring."""

    model: str
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    truncation: Literal["disabled"] | None = None
    background: bool | None = None
    # Accepted and ignored: they cannot change the answer.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # Refused with their reason (each needs what a stateless text-only server lacks).
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: list[str] | None = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    stream_options: Any = None

    _check_previous = field_validator("previous_response_id")(
        _refuse(
            "'previous_response_id' is not supported: this server stores no responses "
            "(store: false); send the whole conversation in 'input'"
        )
    )
    _check_conversation = field_validator("conversation")(
        _refuse("'conversation' is not supported: this server stores no conversations")
    )
    _check_prompt = field_validator("prompt")(
        _refuse("'prompt' (stored prompt templates) is not supported")
    )
    _check_reasoning = field_validator("reasoning")(
        _refuse("'reasoning' is not supported: the served model does not reason")
    )
    _check_top_logprobs = field_validator("top_logprobs")(
        _refuse("'top_logprobs' is not supported on /v1/responses; use /v1/chat/completions")
    )
    _check_max_tool_calls = field_validator("max_tool_calls")(
        _refuse("'max_tool_calls' is not supported")
    )
    _check_stream_options = field_validator("stream_options")(
        _refuse("'stream_options' is not supported")
    )

    @field_validator("input", mode="before")
    @classmethod
    def _default_item_type(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [_item_type(item) for item in value]
        return value

    @field_validator("store")
    @classmethod
    def _not_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("'store' must be false: this server stores no responses")
        return value

    @field_validator("background")
    @classmethod
    def _not_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("'background' is not supported: responses are answered in line")
        return value

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(f"'include' is not supported (asked for {value[0]!r})")
        return value

    # -- to a chat request ----------------------------------------------------------------------

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (validated like one)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.chat_messages(),
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # the final event carries usage
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "parallel_tool_calls"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            response_format: dict[str, Any] = {"type": text_format.type}
            if text_format.type == "json_schema":
                response_format["json_schema"] = {
                    "name": text_format.name,
                    "schema": text_format.schema_,
                    **({"strict": text_format.strict} if text_format.strict is not None else {}),
                }
            body["response_format"] = response_format
        return ChatCompletionRequest.model_validate_json(json.dumps(body))

    def chat_messages(self) -> list[dict[str, Any]]:
        """``instructions`` and ``input`` as chat messages: an assistant's function calls join
        its message (or make one), each output becomes a ``tool`` message."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        names: dict[str, str] = {}
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                names[item.call_id] = item.name
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                message = {"role": "tool", "tool_call_id": item.call_id, "content": item.text}
                if item.call_id in names:
                    message["name"] = names[item.call_id]
                messages.append(message)
        return messages
