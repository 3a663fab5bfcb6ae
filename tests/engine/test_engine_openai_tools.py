"""Tool calls: the parsers on fixed texts, streams that hold back what may be a call, and through
the openai client against a real engine: ``required`` and a named function always give a call
whose arguments validate (grammar-constrained, even from a random model), ``auto`` reads a call
the model wrote (forced with guided_choice) and leaves other text as content, ``none`` gives none,
earlier calls and tool results render, bad tools are 400s naming the field before any slot."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import yaml
from openai.lib.streaming.chat import ChatCompletionStreamState

from slotserve.engine.core.sequence import FinishReason
from slotserve.engine.core.structured import Grammars
from slotserve.engine.core.tool_parsers import PARSERS, choose_parser
from slotserve.engine.http.openai_api import ChatCompletionRequest
from slotserve.engine.http.tool_calls import plan_tools
from slotserve.engine.http.tool_format import ToolChatFormat
from tests.engine.engine_server_support import SLOTSERVE, module_engine
from tests.support import free_port, http_ok, wait_until

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {
        "zone": {"enum": ["UTC", "CET"]},
        "hours": {"type": "integer", "minimum": 0, "maximum": 23},
    },
    "required": ["zone", "hours"],
    "additionalProperties": False,
}


def _tool(name: str, parameters: dict | None = None, **more: str) -> dict:
    function = {"name": name, **more} | ({} if parameters is None else {"parameters": parameters})
    return {"type": "function", "function": function}


TOOLS = [_tool("get_weather", WEATHER, description="Weather now"), _tool("get_time", TIME)]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# ------------------------------------------------------------------------------ parsers (unit)


def test_hermes_parser_reads_calls_after_text_and_leaves_other_text_as_content():
    hermes = PARSERS["hermes"]
    text = (
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    content, calls = hermes.parse(text)
    assert content == "Let me look. "
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "UTC"}),
    ]
    for not_a_call in (
        "Paris is sunny.",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',  # arguments not an object
    ):
        assert hermes.parse(not_a_call) == (not_a_call, [])


def test_llama3_json_parser_reads_one_or_several_calls_and_nothing_else():
    llama = PARSERS["llama3_json"]
    content, calls = llama.parse(' {"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
    assert [(c.name, c.arguments) for c in llama.parse(two)[1]] == [("a", {}), ("b", {"x": 1})]
    for not_a_call in ("Oslo is cold.", '{"city": "Oslo"}', '{"name": "a", "parameters": {}} and'):
        assert llama.parse(not_a_call) == (not_a_call, [])


def test_parser_is_chosen_from_the_flag_or_the_chat_template():
    assert choose_parser("auto", "{{ '<tool_call>' }} {{ tools }}").name == "hermes"
    llama_template = "{{- '<|python_tag|>' }} {{ '\"parameters\": ' }} {{ tools }}"
    assert choose_parser("auto", llama_template).name == "llama3_json"
    assert choose_parser("auto", None).name == "hermes"
    assert choose_parser("llama3_json", "<tool_call>").name == "llama3_json"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


# A pydantic-made schema: its $ref points into its own $defs.
ALARM = {
    "$defs": {"Day": {"enum": ["mon", "tue"]}},
    "type": "object",
    "properties": {"day": {"$ref": "#/$defs/Day"}},
    "required": ["day"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_the_call_grammar_takes_one_call_of_an_allowed_function_with_valid_arguments(
    tokenizer, parser
):
    from llguidance import LLMatcher

    grammars = Grammars(tokenizer)

    call_format = PARSERS[parser]
    grammar = call_format.grammar([("set_alarm", ALARM), ("get_time", TIME)])
    grammars.check(grammar)

    def accepts(name: str, arguments: dict) -> bool:
        compact = json.dumps(arguments, separators=(",", ":"))
        text = f'{{"name": "{name}", "{call_format.arguments_key}": {compact}}}'
        if parser == "hermes":
            text = f"<tool_call>\n{text}\n</tool_call>"
        matcher = LLMatcher(grammars.tokenizer, grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    assert accepts("set_alarm", {"day": "mon"})
    assert accepts("get_time", {"zone": "UTC", "hours": 3})
    assert not accepts("set_alarm", {"day": "sun"})
    assert not accepts("get_time", {"zone": "UTC", "hours": 24})
    assert not accepts("get_weather", {"city": "Oslo", "unit": "celsius"})


def _stream(fmt: ToolChatFormat, pieces: list[str], finish: FinishReason) -> list[dict]:
    """The SSE chunks of one choice fed piece by piece, parsed back."""
    raw = b"".join(fmt.chunk(p, None) for p in pieces[:-1]) + fmt.chunk(pieces[-1], finish)
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    return [json.loads(event)["choices"][0] for event in events]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_stream_sends_text_and_holds_back_what_may_be_a_call(parser):
    call = PARSERS[parser].render_call("get_weather", {"city": "Rome", "unit": "celsius"})
    before = "Checking. " if parser == "hermes" else ""
    text = before + call
    plan = plan_tools(_request(tool_choice="auto"), parser, "")
    chunks = _stream(ToolChatFormat("id", "tiny", plan), list(text), "stop")
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    assert content == before
    # As OpenAI streams a call: id, type and name first, then the arguments.
    head, rest = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    assert head["index"] == rest["index"] == 0 and head["id"].startswith("call_")
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert rest.keys() == {"index", "function"} and rest["function"].keys() == {"arguments"}
    assert json.loads(rest["function"]["arguments"]) == {"city": "Rome", "unit": "celsius"}
    assert chunks[-1]["finish_reason"] == "tool_calls"
    # Text that only looked like a call's beginning is sent in the end, as content.
    plain = "I <tool or not"
    chunks = _stream(ToolChatFormat("id", "tiny", plan), list(plain), "stop")
    assert "".join(c["delta"].get("content") or "" for c in chunks) == plain
    assert chunks[-1]["finish_reason"] == "stop"


def test_a_call_cut_by_max_tokens_is_content_with_finish_length():
    plan = plan_tools(_request(tool_choice="required"), "hermes", "")
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'
    chunks = _stream(ToolChatFormat("id", "tiny", plan), [cut[:5], cut[5:]], "length")
    assert "".join(c["delta"].get("content") or "" for c in chunks) == cut
    assert chunks[-1]["finish_reason"] == "length"


def test_a_template_without_tools_gets_them_in_the_system_turn_and_calls_as_text():
    request = _request(
        tool_choice="auto",
        messages=[
            {"role": "system", "content": "Be brief."},
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    plan = plan_tools(request, "hermes", "{{ messages }}")
    messages, tools = plan.template_input(request.template_messages())
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": PARSERS["hermes"].render_call("get_weather", {"city": "Paris"}),
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # A template that renders tools gets them and the messages as they are.
    messages, tools = plan_tools(request, "hermes", "{{ tools }}").template_input(
        request.template_messages()
    )
    assert tools == TOOLS and messages[2]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }


def _request(**fields) -> ChatCompletionRequest:
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


# -------------------------------------------------------------------- a real engine process


engine, client = module_engine("tools", "--max-batch-size", "4")


def _assembled(stream):
    """A stream's one choice, put together by the openai client's own accumulator."""
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


def _check_call(call, names=("get_weather", "get_time")) -> tuple[str, dict]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return call.function.name, arguments


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_always_gives_a_call_that_validates(client, seed):
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=120, temperature=1.0, seed=seed,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])


def test_a_named_function_is_the_one_called_streamed_or_not(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=120, seed=5
    )
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].finish_reason == "tool_calls"
    name, arguments = _check_call(reply.choices[0].message.tool_calls[0], names=("get_time",))
    streamed = _assembled(client.chat.completions.create(**kwargs, stream=True))
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content
    assert len(streamed.message.tool_calls) == 1
    call = streamed.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == (name, arguments)


def test_required_streamed_with_n_choices(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=120, seed=9, n=2, stream=True,
    )  # fmt: skip
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    choices = state.get_final_completion().choices
    assert [c.index for c in choices] == [0, 1]
    for choice in choices:
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and calls is not None and len(calls) == 1
        _check_call(calls[0])


def test_none_gives_no_calls_and_auto_answers_either_way(client):
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=20, seed=1
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=20, seed=1
    )
    # A random model writes text: it stays content (the parsers' tests cover real calls).
    choice = auto.choices[0]
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_call_the_model_wrote_and_keeps_text_as_content(client, stream):
    """guided_choice makes the random model write exactly these texts; auto reads them."""
    call = PARSERS["hermes"].render_call("get_weather", {"city": "Oslo", "unit": "celsius"})
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=80)
    for text, content, calls in [
        (
            "Let me check. " + call,
            "Let me check. ",
            [("get_weather", {"city": "Oslo", "unit": "celsius"})],
        ),
        ("It is <tool_call> sunny", "It is <tool_call> sunny", []),
    ]:
        if stream:
            choice = _assembled(
                client.chat.completions.create(
                    **kwargs, stream=True, extra_body={"guided_choice": [text]}
                )
            )
        else:
            reply = client.chat.completions.create(**kwargs, extra_body={"guided_choice": [text]})
            choice = reply.choices[0]
        assert choice.message.content == content
        got = [
            (c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls or []
        ]
        assert got == calls
        assert choice.finish_reason == ("tool_calls" if calls else "stop")


def test_a_conversation_with_earlier_calls_and_tool_results_renders(client):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ARGUMENTS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    for choice in ("auto", "none", "required"):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=120
        )
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD_REF = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
JSON = {"type": "json_object"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
        ({"tools": [_tool("f", BAD_REF)]}, "tools.0.function.parameters"),
        ({"tools": [_tool("f", {"type": "string"})]}, "tools.0.function.parameters"),
        ({"tools": TOOLS, "tool_choice": _tool("nope")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": JSON}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_bad_tools_are_400_naming_the_field_before_any_slot(engine, fields, param):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **fields}
    reply = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    load = engine.get_json("/load")
    assert load["slots_free"] == load["slots_total"] and load["waiting"] == 0


@pytest.mark.slow
def test_tool_calls_pass_through_a_real_gateway(engine, tmp_path):
    pool = {
        "model": "tiny",
        "endpoints": [engine.url],
        "batching": {"policy": "continuous", "maxBatchSize": 4},
        "admission": {"maxQueueSize": 16, "queueTimeoutSeconds": 30},
    }
    (tmp_path / "pools.yaml").write_text(yaml.safe_dump({"pools": [pool]}))
    port = free_port()
    argv = [str(SLOTSERVE), "gateway", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--config", str(tmp_path / "pools.yaml"), "--log-level", "WARNING"]
    with (tmp_path / "gateway.log").open("wb") as log:
        gateway = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(f"{url}/ready"), 30, what="gateway /ready")
        via = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        args: dict[str, Any] = dict(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            max_tokens=120, seed=7,
        )  # fmt: skip
        reply = via.chat.completions.create(**args)
        assert reply.choices[0].finish_reason == "tool_calls"
        name, arguments = _check_call(reply.choices[0].message.tool_calls[0])
        calls = _assembled(via.chat.completions.create(**args, stream=True)).message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (name, arguments)
        ]
        with pytest.raises(openai.BadRequestError) as refused:
            via.chat.completions.create(**{**args, "tool_choice": "required", "tools": []})
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["param"] == "tool_choice"
    finally:
        gateway.terminate()
        gateway.wait(timeout=15)
