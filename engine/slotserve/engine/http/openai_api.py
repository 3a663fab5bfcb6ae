"""OpenAI-compatible request bodies for the engine's HTTP API (responses: ``openai_responses``).

Requests are validated strictly from JSON: wrong types, out-of-range values, unknown fields and
OpenAI features the engine does not implement (``functions``, images, ...) are rejected with a
message that names the field, never silently ignored. Fields that cannot change the answer (such
as ``user``) are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from slotserve.engine.core.params import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MaxTokens,
    MinP,
    MinTokens,
    Penalty,
    RepetitionPenalty,
    Temperature,
    TopP,
)
from slotserve.engine.http.choices import MAX_CHOICES
from slotserve.engine.http.tool_calls import Tool, ToolCall, ToolChoice


class RequestModel(BaseModel):
    """Base for request bodies: strict JSON types, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(RequestModel):
    include_usage: bool = False


def _reject_unless(allowed: Callable[[Any], bool], why: str) -> Callable[[Any, Any], Any]:
    """A field validator that refuses any value for which ``allowed`` is false, naming the field."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if not allowed(value):
            raise ValueError(f"'{info.field_name}' {why}")
        return value

    return check


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions (OpenAI + vLLM extensions)."""

    model: str
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    # vLLM's extension; -1 and 0 mean "disabled" there, so both are accepted as "no top-k".
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored: it cannot change the answer

    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    # vLLM's extensions.
    repetition_penalty: RepetitionPenalty = 1.0
    min_p: MinP = 0.0
    min_tokens: MinTokens = 0
    guided_regex: str | None = Field(None, min_length=1, max_length=4096)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=256)
    guided_json: dict[str, Any] | None = None

    n: int = Field(1, ge=1, le=MAX_CHOICES)  # each choice takes a slot (checked per engine)
    # vLLM's: prefix-cache reuse only among requests with the same salt (within the tenant's).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"'logit_bias' keys must be token ids, got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                bound = f"{MAX_LOGIT_BIAS:g}"
                raise ValueError(f"'logit_bias' values must be between -{bound} and {bound}")
        return value

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(key): value for key, value in (self.logit_bias or {}).items()}

    @property
    def num_logprobs(self) -> int | None:
        """How many top alternatives per token to return; None: no logprobs."""
        raise NotImplementedError

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"'stop' allows at most {MAX_STOP_STRINGS} strings")
        if any(not s for s in stops):
            raise ValueError("'stop' strings must not be empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"'stop' strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return value

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def top_k_or_none(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k >= 1 else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        """The number of tokens asked for, or None for 'as many as fit'."""
        raise NotImplementedError


# A batch of prompts in one completion request: OpenAI's bound on the list.
MAX_PROMPTS = 2048


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt (text or token ids) or a batch of them.

    A batch is answered as OpenAI does: ``n`` choices per prompt, choice ``i`` of prompt ``p``
    at index ``p * n + i``. ``echo`` puts the prompt before each choice's text; with
    ``logprobs`` the prompt tokens get theirs too (the first one ``null``). ``max_tokens: 0``
    with ``echo`` scores the prompt without generating (what lm-evaluation-harness sends).
    ``prompt_logprobs`` is vLLM's field: each choice carries the prompt's logprobs in vLLM's
    shape (token id -> logprob, rank, decoded token).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's legacy limit
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extension
    best_of: int | None = None
    suffix: str | None = None

    _check_best_of = field_validator("best_of")(
        _reject_unless(lambda v: v in (None, 1), "must be 1 (best_of is not supported)")
    )
    _check_suffix = field_validator("suffix")(
        _reject_unless(lambda v: v is None, "is not supported")
    )

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(
        cls, value: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        batch = isinstance(value, list) and value and isinstance(value[0], str | list)
        if batch and len(value) > MAX_PROMPTS:
            raise ValueError(f"'prompt' allows at most {MAX_PROMPTS} prompts in one request")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or the batch."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], str | list):
            return list(value)
        return [value]  # type: ignore[list-item]  # list[int]: one prompt of token ids

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """How many top alternatives the prompt tokens need (echo + logprobs, or vLLM's
        ``prompt_logprobs``; the larger of the two), or None: the prompt is not scored."""
        wanted = [
            k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None
        ]
        return max(wanted) if wanted else None


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    @field_validator("tool_calls")
    @classmethod
    def _arguments_are_json_objects(cls, value: list[ToolCall] | None) -> list[ToolCall] | None:
        for call in value or []:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ValueError("'tool_calls' arguments must be a JSON object as a string")
        return value

    @model_validator(mode="after")
    def _tool_fields_with_their_roles(self) -> ChatMessage:
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("'tool_call_id' is required in a 'tool' message, and only there")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("'tool_calls' is only allowed in an 'assistant' message")
        return self

    def template_message(self) -> dict[str, Any]:
        """As chat templates expect it: OpenAI's 'developer' is a system turn, and call
        arguments are objects (templates write them with ``tojson``)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text,
        }
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.role == "tool" and self.name is not None:
            message["name"] = self.name
        return message

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JsonSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # always strict here: the grammar enforces the schema


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.json_schema is None) == (self.type == "json_schema"):
            raise ValueError("'json_schema' is required with type json_schema, and only then")
        return self


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: the chat template of the model's tokenizer is applied."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)  # OpenAI's limit
    tool_choice: ToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("'top_logprobs' requires 'logprobs': true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    _check_functions = field_validator("functions")(
        _reject_unless(
            lambda v: not v, "(deprecated function calling) is not supported; use 'tools'"
        )
    )
    _check_function_call = field_validator("function_call")(
        _reject_unless(lambda v: v in (None, "none"), "is not supported; use 'tool_choice'")
    )

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them."""
        return [message.template_message() for message in self.messages]


# ---------------------------------------------------------------------------------------------
# Validation errors -> one readable message


def describe_validation_error(error: ValidationError) -> tuple[str, str | None, str]:
    """Turn pydantic's first error into (message, param, code) for an OpenAI error body."""
    # The most specific error: for a union, the branch that got furthest into the value.
    first = max(error.errors(include_url=False), key=lambda e: len(e["loc"]))
    loc = [str(part) for part in first["loc"]]
    # Drop union-branch names such as "str" or "list[int]" that pydantic adds to the location.
    param = ".".join(p for p in loc if not _looks_like_type(p)) or None
    kind = first["type"]
    if kind == "json_invalid":
        return f"Request body is not valid JSON: {first['msg']}", None, "invalid_json"
    if kind in {"model_type", "model_attributes_type"} and not loc:
        return "Request body must be a JSON object", None, "invalid_json"
    if kind == "extra_forbidden":
        return f"Unknown field '{param}' is not supported", param, "unsupported_parameter"
    if kind == "missing":
        return f"Missing required field '{param}'", param, "missing_parameter"
    message = str(first["msg"]).removeprefix("Value error, ")
    if kind == "value_error" and message.startswith("'"):
        return message, param, "unsupported_parameter"
    return f"Invalid value for '{param}': {message}", param, "invalid_value"


def _looks_like_type(part: str) -> bool:
    return (
        part in {"str", "int", "float", "bool", "list", "dict", "none"}
        or "[" in part
        or (part[:1].isupper() and part.isidentifier())
    )


def cache_salt_of(gateway_salt: str | None, client_salt: str | None) -> str | None:
    """The salt a request's prefix-cache matches run under: the gateway's (its tenant, from
    ``x-slotserve-cache-salt``) and the client's own ``cache_salt`` within it, so a client can
    split its tenant's cache further but never reach into another tenant's."""
    if gateway_salt is not None and len(gateway_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"the cache salt header is longer than {MAX_CACHE_SALT_CHARS} characters")
    if gateway_salt is None:
        return client_salt
    return gateway_salt if client_salt is None else f"{gateway_salt}\x1f{client_salt}"
