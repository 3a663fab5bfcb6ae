"""Chat outputs with tool calls: ``message.tool_calls`` and ``finish_reason: "tool_calls"``.

Streaming sends text as content until the parser sees that a call may begin, holds the rest,
and at the end sends each call as OpenAI does, in two deltas (index, id, type and name; then all
its arguments), then the finish. A call cut by ``max_tokens`` is no
call: all its text comes back as content with ``finish_reason: "length"``.
"""

from __future__ import annotations

from slotserve.engine.core.logprobs import TokenLogprobs
from slotserve.engine.core.sequence import FinishReason
from slotserve.engine.core.tool_parsers import ParsedCall
from slotserve.engine.http.openai_format import ChatFormat, ChoiceOutput
from slotserve.engine.http.openai_logprobs import chat_logprobs
from slotserve.engine.http.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatDelta,
    ChatMessageOut,
    TokenCounts,
)
from slotserve.engine.http.tool_calls import ToolCall, ToolCallDelta, ToolPlan


class _ChoiceStream:
    """One choice's streamed text: how much went out as content."""

    def __init__(self) -> None:
        self.text = ""
        self.num_sent = 0


class ToolChatFormat(ChatFormat):
    def __init__(self, request_id: str, model: str, plan: ToolPlan) -> None:
        super().__init__(request_id, model)
        self.parser = plan.parser
        self._streams: dict[int, _ChoiceStream] = {}

    def _split(self, text: str, finish_reason: FinishReason | None) -> tuple[str, list[ParsedCall]]:
        if finish_reason != "stop":
            return text, []
        return self.parser.parse(text)

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
        index: int = 0,
    ) -> bytes:
        stream = self._streams.setdefault(index, _ChoiceStream())
        stream.text += text
        chosen = chat_logprobs(logprobs) if logprobs is not None else None
        if finish_reason is None:
            # Never behind what was sent: a call can only begin in the unsent tail.
            hold = max(stream.num_sent, self.parser.hold_from(stream.text))
            content = stream.text[stream.num_sent : hold]
            stream.num_sent = hold
            delta = ChatDelta(content=content)
            return self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=chosen)], None)
        content, calls = self._split(stream.text[stream.num_sent :], finish_reason)
        out = b""
        if content or chosen is not None:
            delta = ChatDelta(content=content)
            out += self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=chosen)], None)
        for i, call in enumerate(calls):
            for call_delta in ToolCallDelta.of(i, ToolCall.from_parsed(call)):
                choice = ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[call_delta]))
                out += self._chunk([choice], None)
        reason = "tool_calls" if calls else finish_reason
        return out + self._chunk(
            [ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)], None
        )

    def response(self, choices: list[ChoiceOutput], counts: TokenCounts) -> str:
        out = []
        for index, choice in enumerate(choices):
            content, calls = self._split(choice.text, choice.finish_reason)
            message = ChatMessageOut(
                content=content if content.strip() or not calls else None,
                tool_calls=[ToolCall.from_parsed(call) for call in calls] or None,
            )
            out.append(
                ChatChoice(
                    index=index,
                    message=message,
                    finish_reason="tool_calls" if calls else choice.finish_reason,
                    logprobs=chat_logprobs(choice.logprobs)
                    if choice.logprobs is not None
                    else None,
                )
            )
        return self._response_json(out, counts)
