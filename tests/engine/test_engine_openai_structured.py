"""Structured output: every finished answer parses and validates against its schema (property test
on a random model), regexes and choices hold, bad grammars and combinations are 400s."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.structured import choice_grammar, json_schema_grammar, regex_grammar
from tests.engine.engine_core_support import build_sharp_tiny_model, make_engine
from tests.engine.engine_server_support import module_engine


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


@pytest.fixture(scope="module")
def engine_core(sharp_model_dir):
    return make_engine(sharp_model_dir, max_batch_size=4)


LEAVES: st.SearchStrategy[dict[str, Any]] = st.sampled_from(
    [
        {"type": "boolean"},
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "string", "maxLength": 8},
        {"enum": ["red", "green", "blue"]},
        {"type": "number", "minimum": -5, "maximum": 5},
        {"type": "null"},
    ]
)


def objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(
        st.from_regex(r"[a-z]{1,6}", fullmatch=True), children, min_size=1, max_size=3
    ).map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": sorted(props),
            "additionalProperties": False,
        }
    )


SCHEMAS: st.SearchStrategy[dict[str, Any]] = st.recursive(
    LEAVES,
    lambda children: (
        objects(children)
        | children.map(lambda item: {"type": "array", "items": item, "maxItems": 3})
    ),
    max_leaves=6,
).filter(lambda schema: schema.get("type") in ("object", "array"))


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schemas=st.lists(SCHEMAS, min_size=3, max_size=3), seed=st.integers(0, 10_000))
def test_finished_answers_always_validate_against_their_schema(engine_core, schemas, seed):
    """Three schemas in one batch, sampled at temperature 1 from a random model."""
    params = [
        SamplingParams(
            max_tokens=80, temperature=1.0, seed=seed + i, grammar=json_schema_grammar(s)
        )
        for i, s in enumerate(schemas)
    ]
    results = engine_core.generate(["a", "the answer is", "{"], params)
    for schema, result in zip(schemas, results, strict=True):
        if result.finish_reason == "length":
            continue  # cut by max_tokens: the only way out of the grammar
        assert result.finish_reason == "stop", result
        jsonschema.validate(json.loads(result.text), schema)


def test_regex_and_choice_hold_and_most_schemas_finish(engine_core):
    pattern = r"[0-9]{3}-[a-z]{2}"
    params = [
        SamplingParams(max_tokens=20, temperature=1.0, seed=i, grammar=regex_grammar(pattern))
        for i in range(3)
    ] + [SamplingParams(max_tokens=20, grammar=choice_grammar(["yes", "no", "maybe so"]))]
    results = engine_core.generate(["x", "y", "z", "w"], params)
    for result in results[:3]:
        assert re.fullmatch(pattern, result.text) and result.finish_reason == "stop"
    assert results[3].text in {"yes", "no", "maybe so"}


# -------------------------------------------------------------------- a real engine process


engine, client = module_engine("structured", "--max-batch-size", "4", model="sharp_model_dir")


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lyon"]}, "people": {"type": "integer"}},
    "required": ["city", "people"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Which city?"}]


def test_json_schema_and_json_object_through_the_openai_client(client):
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=40,
        seed=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
        },
    )
    if reply.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=40, seed=3, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        )
        if chunk.choices
    )  # fmt: skip
    assert streamed == reply.choices[0].message.content
    obj = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(
        model="tiny", prompt="x", max_tokens=5, extra_body={"guided_choice": ["left", "right"]}
    )
    assert choice.choices[0].text in {"left", "right"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
            "guided_json",
        ),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
        ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_bad_grammars_are_400_naming_the_field_before_any_slot(engine, extra, param):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    reply = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    load = engine.get_json("/load")
    assert load["slots_free"] == load["slots_total"] and load["waiting"] == 0
