"""Unit tests of the OpenAI request models: what is accepted, what is refused with a clear 400."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from slotserve.engine.http.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    describe_validation_error,
)


def parse(cls, **body):
    return cls.model_validate_json(json.dumps(body))


def refusal(cls, raw: str) -> tuple[str, str | None, str]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate_json(raw)
    return describe_validation_error(info.value)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_completion_defaults_match_openai():
    req = parse(CompletionRequest, model="m", prompt="hello")
    assert req.max_tokens == 16
    assert req.temperature == 1.0
    assert req.stop_list == []
    assert not req.include_usage


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", "hi"), (["hi"], "hi"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_one_prompt_in_any_openai_shape(prompt, expected):
    assert parse(CompletionRequest, model="m", prompt=prompt).prompts == [expected]


def test_batched_prompts_are_read_as_a_batch():
    # Served since issue 28 (lm-eval batches prompts): tests/engine/test_engine_echo_logprobs.py
    assert parse(CompletionRequest, model="m", prompt=["a", "b"]).prompts == ["a", "b"]
    assert parse(CompletionRequest, model="m", prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]


# logprobs, penalties, logit_bias and n are supported now: tests/engine/test_engine_openai_*.py
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"best_of": 3}, "best_of"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_unsupported_completion_fields_are_named(extra, param):
    message, got_param, code = refusal(
        CompletionRequest, json.dumps({"model": "m", "prompt": "x", **extra})
    )
    assert got_param == param
    assert param in message
    assert code == "unsupported_parameter"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"modalities": ["audio"]}, "modalities"),
    ],
)
def test_unsupported_chat_fields_are_named(extra, param):
    message, got_param, _ = refusal(ChatCompletionRequest, json.dumps({**CHAT, **extra}))
    assert got_param == param
    assert param in message


def test_harmless_fields_are_accepted():
    req = parse(
        ChatCompletionRequest,
        **CHAT,
        user="alice",
        n=1,
        tool_choice="none",
        response_format={"type": "text"},
        presence_penalty=0,
    )
    assert req.user == "alice"


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        ('{"model":"m","prompt":"x","temperature":"hot"}', "temperature", "invalid_value"),
        ('{"model":"m","prompt":"x","temperature":2.5}', "temperature", "invalid_value"),
        ('{"model":"m","prompt":"x","top_p":0}', "top_p", "invalid_value"),
        ('{"model":"m","prompt":"x","max_tokens":-1}', "max_tokens", "invalid_value"),
        ('{"model":"m","prompt":"x","max_tokens":"5"}', "max_tokens", "invalid_value"),
        ('{"model":"m","prompt":"x","max_tokens":true}', "max_tokens", "invalid_value"),
        ('{"model":"m","prompt":"x","stream":"yes"}', "stream", "invalid_value"),
        ('{"model":"m","prompt":7}', "prompt", "invalid_value"),
        ('{"model":"m"}', "prompt", "missing_parameter"),
        ('{"prompt":"x"}', "model", "missing_parameter"),
        ('{"model":"m","prompt":"x"', None, "invalid_json"),
        ("[1, 2]", None, "invalid_json"),
        ("", None, "invalid_json"),
    ],
)
def test_bad_values_name_the_field(raw, param, code):
    _, got_param, got_code = refusal(CompletionRequest, raw)
    assert (got_param, got_code) == (param, code)


def test_stop_accepts_string_or_list_and_is_bounded():
    assert parse(CompletionRequest, model="m", prompt="x", stop="\n").stop_list == ["\n"]
    assert parse(CompletionRequest, model="m", prompt="x", stop=["a", "b"]).stop_list == ["a", "b"]
    _, param, _ = refusal(
        CompletionRequest, json.dumps({"model": "m", "prompt": "x", "stop": ["s"] * 17})
    )
    assert param == "stop"


def test_stream_options_need_stream():
    _, param, _ = refusal(
        CompletionRequest,
        '{"model":"m","prompt":"x","stream_options":{"include_usage":true}}',
    )
    assert param == "stream_options"
    req = parse(
        CompletionRequest,
        model="m",
        prompt="x",
        stream=True,
        stream_options={"include_usage": True},
    )
    assert req.include_usage


def test_chat_max_completion_tokens_wins_and_default_is_open():
    assert parse(ChatCompletionRequest, **CHAT).requested_max_tokens() is None
    assert parse(ChatCompletionRequest, **CHAT, max_tokens=5).requested_max_tokens() == 5
    req = parse(ChatCompletionRequest, **CHAT, max_tokens=5, max_completion_tokens=9)
    assert req.requested_max_tokens() == 9


def test_chat_messages_text_parts_and_developer_role():
    req = parse(
        ChatCompletionRequest,
        model="m",
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


def test_chat_refuses_images_unknown_roles_and_empty_conversations():
    image = {
        **CHAT,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
    }
    _, param, _ = refusal(ChatCompletionRequest, json.dumps(image))
    assert param is not None and param.startswith("messages.0.content")
    function = {**CHAT, "messages": [{"role": "function", "content": "x"}]}
    assert refusal(ChatCompletionRequest, json.dumps(function))[1] == "messages.0.role"
    tool = {**CHAT, "messages": [{"role": "tool", "content": "x"}]}  # answers which call?
    message, param, _ = refusal(ChatCompletionRequest, json.dumps(tool))
    assert param == "messages.0" and "tool_call_id" in message
    assert refusal(ChatCompletionRequest, json.dumps({**CHAT, "messages": []}))[1] == "messages"


def test_top_k_disabled_values_follow_vllm():
    assert parse(CompletionRequest, model="m", prompt="x", top_k=-1).top_k_or_none is None
    assert parse(CompletionRequest, model="m", prompt="x", top_k=0).top_k_or_none is None
    assert parse(CompletionRequest, model="m", prompt="x", top_k=40).top_k_or_none == 40
