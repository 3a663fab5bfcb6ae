"""/v1/responses on the engine (issue 28): input items to chat messages, the response object and
its stream events through the official openai client, and every refusal naming its field."""

from __future__ import annotations

import json

import httpx
import pytest

from slotserve.engine.http.responses_api import ResponsesRequest
from tests.engine.engine_server_support import module_engine

engine, client = module_engine("responses", "--max-batch-size", "2", "--max-model-len", "512")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def test_input_items_become_the_chat_a_model_was_trained_on():
    body = ResponsesRequest.model_validate_json(
        json.dumps(
            {
                "model": "m",
                "instructions": "Be brief.",
                "input": [
                    {"role": "user", "content": "Weather in Paris?"},
                    {
                        "type": "message",
                        "role": "assistant",
                        "id": "msg_1",
                        "status": "completed",
                        "content": [
                            {"type": "output_text", "text": "Checking.", "annotations": []}
                        ],
                    },
                    {
                        "type": "function_call",
                        "call_id": "call_1",
                        "name": "get_weather",
                        "arguments": '{"city": "Paris"}',
                    },
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                    {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
                ],
            }
        )
    )
    assert body.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"},
        {"role": "user", "content": "Thanks"},
    ]
    chat = body.chat_request()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]


def test_a_response_and_its_stream(client):
    args = dict(model="tiny", input="Once upon a time", max_output_tokens=6, temperature=0)
    reply = client.responses.create(**args)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 6
    assert reply.store is False and reply.previous_response_id is None
    events = list(client.responses.create(**args, stream=True))
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e.type for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == reply.output_text == events[-1].response.output_text


def test_tool_choice_and_text_format(client):
    named = client.responses.create(
        model="tiny",
        input="Weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    events = list(
        client.responses.create(
            model="tiny",
            input="Weather?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=60,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds
    assert events[-1].response.output[-1].type == "function_call"
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": [1, 2, 3]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    shaped = client.responses.create(
        model="tiny",
        input="A number",
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
        max_output_tokens=40,
    )
    assert json.loads(shaped.output_text)["answer"] in (1, 2, 3)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"store": True}, "store"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.message.content",
        ),
        ({"input": []}, "input"),
    ],
)
def test_refusals_name_the_field(engine, extra, param):
    body = {"model": "tiny", "input": "hi", **extra}
    reply = httpx.post(engine.url + "/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert engine.get_json("/load")["running"] == 0
