"""Tool calls with a chat template that renders tools itself (Llama 3 style, so ``auto`` picks the
llama3_json parser), and the real SmolLM2 asked for a weather call."""

from __future__ import annotations

import json
import shutil
from typing import Any

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

from tests.engine.engine_server_support import EngineProcess

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER,
        },
    }
]
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather like in Paris today?"}
]

# A Llama 3.1-like template over SmolLM2's tokens: tools in the system turn, earlier calls as
# JSON with "parameters", tool results as ipython turns.
LLAMA3_LIKE_TEMPLATE = """
{%- if tools %}<|im_start|>system
Respond with a JSON for a function call: {"name": function name, "parameters": arguments}.
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<|python_tag|>{{ {"name": call.function.name, "parameters": call.function.arguments} | tojson }}
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>ipython
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
""".strip()


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("llama3-template") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(LLAMA3_LIKE_TEMPLATE)
    engine = EngineProcess(model_dir, model_dir.parent / "engine.log", "--max-batch-size", "4")
    engine.start()
    yield openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    engine.stop()


def test_the_template_renders_tools_and_earlier_calls(client):
    def prompt_tokens(messages: list[ChatCompletionMessageParam], tool_choice: str) -> int:
        reply = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=1
        )
        return reply.usage.prompt_tokens

    # "none" shows the model no tools; "auto" lets the template render them.
    assert prompt_tokens(MESSAGES, "auto") > prompt_tokens(MESSAGES, "none") + 20
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    call: ChatCompletionMessageFunctionToolCallParam = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    history: list[ChatCompletionMessageParam] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    assert prompt_tokens(history, "none") > prompt_tokens(MESSAGES, "none") + 15


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_a_llama3_json_call_that_validates(client, stream):
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=120, temperature=1.0, seed=4,
    )  # fmt: skip
    if stream:
        state = ChatCompletionStreamState()  # the openai client's own accumulator
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            state.handle_chunk(chunk)
        choice = state.get_final_completion().choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    else:
        reply = client.chat.completions.create(**kwargs)
        calls, finish = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
    assert finish == "tool_calls" and calls is not None and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


@pytest.mark.slow
def test_smollm2_calls_the_weather_tool_for_paris(smollm2_engine):
    client = openai.OpenAI(base_url=smollm2_engine.url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=80, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls is not None  # a "tool_calls" finish carries them
    call = calls[0]
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)  # a function tool's call
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "paris" in arguments["city"].lower(), arguments
