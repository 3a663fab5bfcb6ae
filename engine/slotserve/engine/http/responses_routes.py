"""``POST /v1/responses``: a Responses API request run as a chat request, answered as a
``response`` object or as the Responses stream events.

The stream sends, in order: ``response.created``, ``response.in_progress``; for text,
``response.output_item.added`` (a message), ``response.content_part.added``, then
``response.output_text.delta`` as text comes, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; for each function call
``response.output_item.added``, ``response.function_call_arguments.delta`` and ``.done``,
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut the answer) with the usage. Each event is ``event: TYPE`` plus its
JSON with a growing ``sequence_number``. The stream then ends with ``data: [DONE]`` as the other
endpoints' streams do: OpenAI's clients stop there, and the gateway takes it as the sign that the
engine's answer is whole. A request that fails mid-stream ends with an error event and no
``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from slotserve.engine.core.logprobs import TokenLogprobs
from slotserve.engine.core.sequence import FinishReason
from slotserve.engine.http.http_state import STATE, ApiError
from slotserve.engine.http.openai_format import ChoiceOutput, OutputFormat
from slotserve.engine.http.openai_responses import TokenCounts
from slotserve.engine.http.openai_routes import _admit, _parse_body, run_chat
from slotserve.engine.http.responses_api import ResponsesRequest
from slotserve.engine.http.tool_calls import ToolCall, ToolPlan


async def responses(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = _admit(state)
    body = await _parse_body(request, ResponsesRequest, state)
    try:
        chat = body.chat_request()
    except ValueError as error:  # pydantic's ValidationError: the translated request refused
        state.metrics.reject("invalid")
        raise ApiError(
            400, f"invalid 'input': {error}", param="input", code="invalid_value"
        ) from error

    def make_format(request_id: str, tools: ToolPlan) -> OutputFormat:
        return ResponsesFormat(request_id, engine.model_name, body, tools)

    return await run_chat(request, state, engine, chat, make_format, id_prefix="resp_")


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


class ResponsesFormat(OutputFormat):
    """Outputs -> a ``response`` object, or the stream's events (one choice: no ``n``)."""

    def __init__(self, request_id: str, model: str, body: ResponsesRequest, plan: ToolPlan) -> None:
        super().__init__(request_id, model)
        self.body = body
        self.parser = plan.parser if plan.parses else None
        self.created = int(time.time())
        self._sequence = 0
        self._text = ""  # the whole output text so far
        self._sent = 0  # characters of it sent as message deltas
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._message_open = False
        self._final: tuple[list[dict[str, Any]], FinishReason | None] | None = None

    # -- the response object --------------------------------------------------------------------

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        finish_reason: FinishReason | None = None,
    ) -> dict[str, Any]:
        body = self.body
        tools = [tool.model_dump(exclude_none=True, by_alias=True) for tool in body.tools or []]
        tool_choice: Any = body.tool_choice or ("auto" if tools else "none")
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        text = (
            body.text.model_dump(exclude_none=True, by_alias=True)
            if body.text is not None and body.text.format is not None
            else {"format": {"type": "text"}}
        )
        incomplete = status == "incomplete"
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "background": False,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "text": text,
            "tool_choice": tool_choice,
            "tools": tools,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
        }

    @staticmethod
    def _usage(counts: TokenCounts) -> dict[str, Any]:
        return {
            "input_tokens": counts.prompt,
            "input_tokens_details": {"cached_tokens": counts.cached},
            "output_tokens": counts.generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.prompt + counts.generated,
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self._message_id,
            "status": status,
            "role": "assistant",
            "content": [self._part(text)],
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _call(call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call.id.removeprefix('call_')}",
            "call_id": call.id,
            "name": call.function.name,
            "arguments": call.function.arguments if arguments is None else arguments,
            "status": status,
        }

    def _split(self, text: str, finish_reason: FinishReason | None) -> tuple[str, list[ToolCall]]:
        """The answer's text and its calls (parsed only from an answer that ended itself)."""
        if self.parser is None or finish_reason != "stop":
            return text, []
        content, calls = self.parser.parse(text)
        return content, [ToolCall.from_parsed(call) for call in calls]

    def _output(self, text: str, calls: list[ToolCall], status: str) -> list[dict[str, Any]]:
        output = [self._message(text, status)] if text or not calls else []
        return output + [self._call(call, "completed") for call in calls]

    def response(self, choices: list[ChoiceOutput], counts: TokenCounts) -> str:
        (choice,) = choices
        text, calls = self._split(choice.text, choice.finish_reason)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        usage = self._usage(counts)
        return json.dumps(self._response(status, self._output(text, calls, status), usage))

    # -- the stream -----------------------------------------------------------------------------

    def _emit(self, kind: str, **payload: Any) -> bytes:
        self._sequence += 1
        return _event(kind, {"sequence_number": self._sequence - 1, **payload})

    def first_chunk(self, index: int = 0) -> bytes:
        opening = self._response("in_progress", [])
        return self._emit("response.created", response=opening) + self._emit(
            "response.in_progress", response=opening
        )

    def _open_message(self) -> bytes:
        if self._message_open:
            return b""
        self._message_open = True
        return self._emit(
            "response.output_item.added",
            output_index=0,
            item={**self._message("", "in_progress"), "content": []},
        ) + self._emit(
            "response.content_part.added",
            item_id=self._message_id,
            output_index=0,
            content_index=0,
            part=self._part(""),
        )

    def _delta(self, upto: int) -> bytes:
        delta = self._text[self._sent : upto]
        if not delta:
            return b""
        self._sent = upto
        return self._open_message() + self._emit(
            "response.output_text.delta",
            item_id=self._message_id,
            output_index=0,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
        index: int = 0,
    ) -> bytes:
        self._text += text
        if finish_reason is None:
            # Text that may begin a call is held until the answer ends (as chat's tool format).
            hold = len(self._text)
            if self.parser is not None:
                hold = max(self._sent, self.parser.hold_from(self._text))
            return self._delta(hold)
        content, calls = self._split(self._text[self._sent :], finish_reason)
        status = "incomplete" if finish_reason == "length" else "completed"
        out = b""
        if content or not calls or self._message_open:
            self._text = self._text[: self._sent] + content
            out += self._delta(len(self._text)) + self._open_message()
            whole = self._text
            out += self._emit(
                "response.output_text.done",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                text=whole,
                logprobs=[],
            )
            out += self._emit(
                "response.content_part.done",
                item_id=self._message_id,
                output_index=0,
                content_index=0,
                part=self._part(whole),
            )
            out += self._emit(
                "response.output_item.done", output_index=0, item=self._message(whole, status)
            )
        items = [self._message(self._text, status)] if self._message_open else []
        for call in calls:
            output_index = len(items)
            item_id = self._call(call, "completed")["id"]
            out += self._emit(
                "response.output_item.added",
                output_index=output_index,
                item=self._call(call, "in_progress", arguments=""),
            )
            out += self._emit(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=output_index,
                delta=call.function.arguments,
            )
            out += self._emit(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=output_index,
                name=call.function.name,
                arguments=call.function.arguments,
            )
            done = self._call(call, "completed")
            out += self._emit("response.output_item.done", output_index=output_index, item=done)
            items.append(done)
        self._final = (items, finish_reason)
        return out

    def usage_chunk(self, counts: TokenCounts) -> bytes:
        items, finish_reason = self._final or ([], None)
        status = "incomplete" if finish_reason == "length" else "completed"
        usage = self._usage(counts)
        final = self._response(status, items, usage)
        return self._emit(f"response.{status}", response=final)
