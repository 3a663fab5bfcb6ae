"""Fuzzed request bodies against a real engine process (tiny model): whatever a client sends, the
answer is 200, 400, 413 or 429 (404 for a well-formed request naming another model), every error
has OpenAI's body, and the engine then serves real requests exactly as before.

Bodies are random and mutated: wrong types, out-of-range and huge numbers, NaN, unicode and lone
surrogates, deep nesting, invalid JSON, JSON that is not an object, odd content types and
encodings. Time is bounded: ``max_model_len`` 64 keeps every generation under 64 tokens, and the
example counts below keep the module well under a minute.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.engine_server_support import EngineProcess

ALLOWED = {200, 400, 413, 429}
MAX_MODEL_LEN = 64
BODY_LIMIT = 65536
FUZZ = settings(
    deadline=None,  # one slow example on a busy machine is not a bug; the client timeout is
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies -------------------------------------------------------------------------------

leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(),  # NaN and infinities too: json.dumps writes them, and they are not JSON
    st.text(max_size=12),
)
any_json = st.recursive(
    leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=10,
)


def repeated(text: str, low: int, high: int) -> st.SearchStrategy[str]:
    """Long strings, cheaply (hypothesis draws a text character by character)."""
    return st.integers(low, high).map(lambda n: (text * n)[:n])


# Values a client may well send: edge cases the engine must serve (or refuse by its rules).
text = st.one_of(
    st.text(max_size=20),
    st.text(alphabet="ab =\n\u00e9\u65e5\U0001f389\ufffd\x00", max_size=20),
    repeated("xy ", 5000, 6000),  # over the characters bound (64 tokens x 81 characters)
)
token_ids = st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=70)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.sampled_from([0, 0.0, 1e-40, 1e-6, 0.7, 2]) | st.floats(0, 2),
    "top_p": st.sampled_from([1, 1e-300, 0.5]) | st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 50) | st.just(10**30),
    "seed": st.integers(-(2**70), 2**70),
    "stop": st.text(min_size=1, max_size=4)
    | st.lists(st.text(min_size=1, max_size=4), max_size=16)
    | st.lists(repeated("=", 1000, 1024), max_size=16),
    "stop_token_ids": st.lists(st.integers(0, 10**30), max_size=8),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "user": st.text(max_size=8),
    "n": st.just(1),
    "presence_penalty": st.just(0.0),
    "frequency_penalty": st.just(0),
    "logit_bias": st.just({}),
    "max_tokens": st.integers(1, 4),
}
COMPLETION_ONLY = {
    "echo": st.just(False),
    "logprobs": st.none(),
    "best_of": st.sampled_from([None, 1]),
    "suffix": st.none(),
}
part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": text | st.lists(part, max_size=3) | st.none(),
    },
    optional={"name": st.text(max_size=4)},
)
CHAT_ONLY: dict[str, st.SearchStrategy[Any]] = {
    "max_completion_tokens": st.integers(1, 4),
    "logprobs": st.just(False),
    "top_logprobs": st.none(),
    "tools": st.sampled_from([None, []]),
    "tool_choice": st.sampled_from([None, "none"]),
    "response_format": st.just({"type": "text"}),
}
completion = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "prompt": text | token_ids | st.lists(text, max_size=2) | st.lists(token_ids, max_size=2),
    },
    optional={**VALID, **COMPLETION_ONLY},
)
chat = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "messages": st.lists(message, min_size=1, max_size=3),
        "max_tokens": st.integers(1, 4),
    },
    optional={
        name: values for name, values in {**VALID, **CHAT_ONLY}.items() if name != "max_tokens"
    },
)

# What a careless or hostile client sends instead.
huge_int = st.integers(min_value=10**15, max_value=10**40) | st.integers(max_value=-(10**15))
wild = st.one_of(
    any_json,
    huge_int,
    st.integers(-5, 5),
    st.sampled_from([float("nan"), float("inf"), -0.0, 1e308, 5e-324, "", "1", True, [], {}]),
    repeated("[", 1, 5000),
    st.lists(st.integers(-(10**30), 10**30), max_size=5),
    st.lists(st.text(max_size=3), max_size=20),
)


@st.composite
def mutated(draw: st.DrawFn, bodies: st.SearchStrategy) -> dict:
    """A body as a client may send it: valid, or with one field wrong, missing or unknown."""
    body = draw(bodies)
    action = draw(st.sampled_from(["keep", "keep", "wild", "wild", "drop", "add"]))
    if action == "wild":
        name = draw(st.sampled_from(sorted({*body, *VALID, "stream_options", "model"})))
        body[name] = draw(wild)
    elif action == "drop":
        del body[draw(st.sampled_from(sorted(body)))]
    elif action == "add":
        body[draw(st.text(min_size=1, max_size=8))] = draw(any_json)
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


def deep(opening: bytes, closing: bytes) -> st.SearchStrategy[bytes]:
    return st.integers(1, 200_000).map(lambda n: opening * n + closing * n)


raw_bytes = st.one_of(
    st.binary(max_size=100),
    deep(b"[", b"]"),
    deep(b'{"a":', b"}"),
    deep(b"[", b""),  # unterminated
    st.builds(
        lambda n: (
            b'{"model":"tiny","prompt":"a","max_tokens":1,"user":' + b"[" * n + b"]" * n + b"}"
        ),
        st.integers(1, 100_000),
    ),
    any_json.map(lambda v: json.dumps(v).encode()),  # JSON that is not an object
    st.sampled_from(
        [
            b'{"model":"tiny","prompt":"a","max_tokens":1e999999}',
            b'{"model":"tiny","prompt":"a","max_tokens":-0}',
            b'{"model":"tiny","prompt":"a","max_tokens":' + b"9" * 5000 + b"}",
            b'{"model":"tiny","prompt":"\\ud800","max_tokens":1}',
            b'{"model":"tiny","prompt":"\\udfff\\ud800x","max_tokens":1}',
            b'{"model":"tiny","prompt":"\xff\xfe","max_tokens":1}',
            b'{"model":"tiny","prompt":"a","prompt":"b","max_tokens":1}',
            b'{"model":"tiny","messages":[{"role":"user","content":"\\ud83d"}],"max_tokens":1}',
            b'{"model":"tiny","prompt":"a\\u0000b","max_tokens":1}',
            b"\xef\xbb\xbf" + b'{"model":"tiny","prompt":"a","max_tokens":1}',
            b"",
            b"null",
            b" ",
        ]
    ),
)
content_type = st.sampled_from(
    [
        "application/json",
        "application/json; charset=utf-8",
        "application/json; charset=utf-16",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "",
        "\u00e9/\u00e9",
    ]
)
path = st.sampled_from(["/v1/completions", "/v1/chat/completions"])


# Answers seen, by status (printed at the end: how much of the fuzz reached the model).
STATUSES: Counter[int] = Counter()

# -- checks -----------------------------------------------------------------------------------


def check_answer(response: httpx.Response, request_body: object) -> None:
    status = response.status_code
    STATUSES[status] += 1
    named_other_model = isinstance(request_body, dict) and request_body.get("model") != "tiny"
    allowed = ALLOWED | ({404} if named_other_model else set())
    assert status in allowed, (status, response.text[:500], repr(request_body)[:500])
    if status != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["type"]
        assert "code" in error and (error["code"] is None or isinstance(error["code"], str))
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
        return
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] in {"stop", "length"}, answer


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    proc = EngineProcess(
        tiny_model_dir,
        tmp_path_factory.mktemp("engine-fuzz") / "engine.log",
        "--max-batch-size", "4",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-request-body-bytes", str(BODY_LIMIT),
    )  # fmt: skip
    try:
        yield proc.start()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(engine):
    with httpx.Client(base_url=engine.url, timeout=30) as client:
        yield client


REAL_REQUESTS = [
    ("/v1/completions", {"model": "tiny", "prompt": "hello there", "max_tokens": 8}),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    ),
]


def real_answers(client: httpx.Client) -> list[str]:
    """Greedy answers to plain requests (and a stream), to compare before and after."""
    answers = []
    for endpoint, body in REAL_REQUESTS:
        for stream in (False, True):
            response = client.post(endpoint, json={**body, "temperature": 0, "stream": stream})
            assert response.status_code == 200, response.text
            answers.append(response.text if stream else json.dumps(response.json()["choices"]))
    # Stream chunks carry ids and timestamps; keep only what they say.
    return [
        "".join(
            json.dumps(json.loads(line[6:]).get("choices"))
            for line in a.splitlines()
            if line.startswith("data: {")
        )
        if a.startswith("data:")
        else a
        for a in answers
    ]


@pytest.fixture(scope="module")
def before(client):
    return real_answers(client)


# 400 bodies (was 1,000: 40-50 ms each, ~50 s of a 16-minute suite): every mutation kind and
# every field is still drawn many times over.
@settings(FUZZ, max_examples=400)
@given(
    request=st.tuples(st.just("/v1/completions"), mutated(completion))
    | st.tuples(st.just("/v1/chat/completions"), mutated(chat))
    | st.tuples(path, mutated(completion | chat)),  # the wrong endpoint for the body
    ascii_only=st.booleans(),
)
def test_fuzzed_json_bodies(client, before, request, ascii_only):
    endpoint, body = request
    try:
        data = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    except ValueError:
        return
    response = client.post(endpoint, content=data, headers={"Content-Type": "application/json"})
    check_answer(response, body if _is_json(data) else None)


@settings(FUZZ, max_examples=1200)
@given(endpoint=path, data=raw_bytes, kind=content_type, gzipped=st.booleans())
def test_fuzzed_raw_bodies_and_content_types(client, before, endpoint, data, kind, gzipped):
    headers = {"Content-Type": kind.encode()}
    if gzipped:
        data, headers["Content-Encoding"] = gzip.compress(data), "gzip"
    response = client.post(endpoint, content=data, headers=headers)
    check_answer(response, None)


@settings(FUZZ, max_examples=100)
@given(endpoint=path, data=st.binary(min_size=1, max_size=64), kind=content_type)
def test_broken_or_huge_compressed_bodies(client, before, endpoint, data, kind):
    # Not gzip at all, then a gzip bomb: 1 MB of spaces that is ~1 kB on the wire.
    for body in (data, gzip.compress(b" " * 1_000_000 + data)):
        response = client.post(
            endpoint,
            content=body,
            headers={"Content-Type": kind.encode(), "Content-Encoding": "gzip"},
        )
        check_answer(response, None)


def test_the_engine_serves_as_before_after_the_fuzz(engine, client, before):
    """Runs after the fuzz tests (file order): same greedy answers, nothing failed or leaked."""
    print(f"fuzzed answers by status: {dict(sorted(STATUSES.items()))}")
    assert real_answers(client) == before
    deadline = time.monotonic() + 10
    while engine.get_json("/load")["running"] or engine.get_json("/load")["waiting"]:
        assert time.monotonic() < deadline, engine.get_json("/load")
        time.sleep(0.1)
    assert engine.status("/health") == 200 and engine.status("/ready") == 200
    failures = {
        labels: value
        for (name, labels), value in engine.metrics().items()
        if name.endswith(("sequence_failures_total", "step_failures_total")) and value
    }
    assert not failures, failures


def _is_json(data: bytes) -> bool:
    try:
        value = json.loads(data)
    except ValueError:
        return False
    return _finite(value)


def _finite(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True
