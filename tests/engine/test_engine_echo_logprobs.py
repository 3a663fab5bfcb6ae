"""echo and prompt logprobs on /v1/completions (issue 28), and vLLM's tokenizer endpoints.

Prompt logprobs come from the prefill's own hidden states: checked against transformers' logits
on the same weights (fp32), through chunked prefill, a batch of prompts and the prefix cache
(which a scoring request bypasses: it computes its whole prompt).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from slotserve.engine.core.params import SamplingParams
from tests.engine.engine_core_support import make_engine
from tests.engine.engine_server_support import module_engine

# ------------------------------------------------------------------------------ the engine core


def hf_prompt_logprobs(model_dir, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)


def test_prompt_logprobs_are_transformers_own_through_chunks_and_the_prefix_cache(
    tiny_model_dir,
):
    # 16-token steps: a 40-token prompt is prefilled in 3 chunks, next to another sequence.
    engine = make_engine(tiny_model_dir, max_batched_tokens=16, max_batch_size=2)
    prompt = [(i * 37 + 11) % 4000 + 50 for i in range(40)]
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([prompt], plain)  # its row now holds the prompt: a prefix-cache hit is ready
    hits = engine.stats().prefix_cache_hits_total
    scored = engine.add_request("scored", prompt, plain.model_copy(update={"prompt_logprobs": 3}))
    engine.add_request("neighbour", prompt[::-1], plain)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert engine.stats().prefix_cache_hits_total == hits  # bypassed: the whole prompt computed
    first = next(o for o in outputs if o.request_id == "scored" and o.prompt_logprobs)
    entries = first.prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == len(prompt)
    assert first.prompt_tokens is not None and len(first.prompt_tokens) == len(prompt)
    expected = hf_prompt_logprobs(tiny_model_dir, prompt)
    for i in range(1, len(prompt)):
        row = expected[i - 1]
        entry = entries[i]
        assert entry is not None
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(row[prompt[i]]), abs=1e-4)
        assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        assert list(entry.top_ids) == row.topk(3).indices.tolist()
    assert scored.num_prompt_logprobs_done == len(prompt)
    # Once its prompt is scored a sequence may reuse a cached prefix again (after a preemption).
    assert scored.max_reusable_tokens == len(scored.token_ids) - 1


# -------------------------------------------------------------------- a real engine process

engine, client = module_engine("echo", "--max-batch-size", "4", "--max-model-len", "256")


def complete(engine, **body) -> httpx.Response:
    return httpx.post(engine.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)


def test_lm_eval_scoring_request_with_token_ids_and_a_batch(engine):
    prompts = [[100, 200, 300, 400], [500, 600, 700]]
    reply = complete(engine, prompt=prompts, echo=True, max_tokens=0, logprobs=1, temperature=0)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 0,
        "total_tokens": 7,
        # Prompt logprobs need every prompt token computed: nothing comes from the cache.
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    for choice, prompt in zip(body["choices"], prompts, strict=True):
        logprobs = choice["logprobs"]
        assert choice["finish_reason"] == "length"
        assert len(logprobs["tokens"]) == len(prompt)  # the prompt only: max_tokens 0
        assert choice["text"] == "".join(logprobs["tokens"])
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        for token, logprob, top in zip(
            logprobs["tokens"][1:],
            logprobs["token_logprobs"][1:],
            logprobs["top_logprobs"][1:],
            strict=True,
        ):
            assert top[token] == logprob and len(top) <= 2
        assert logprobs["text_offset"][0] == 0
    # lm-eval's own request: max_tokens 1, then [ctxlen:-1] drops the generated token.
    one = complete(engine, prompt=prompts, echo=True, max_tokens=1, logprobs=1, temperature=0)
    for scored, generated in zip(body["choices"], one.json()["choices"], strict=True):
        n = len(scored["logprobs"]["tokens"])
        assert generated["logprobs"]["token_logprobs"][:n] == pytest.approx(
            scored["logprobs"]["token_logprobs"], abs=1e-5
        )
        assert len(generated["logprobs"]["tokens"]) == n + 1
        assert generated["text"].startswith(scored["text"])


def test_text_offsets_point_into_the_echoed_text(engine):
    text = "Caf\u00e9 \U0001f600 na\u00efve \u4e2d\u6587 end"  # characters split over byte tokens
    reply = complete(engine, prompt=text, echo=True, max_tokens=2, logprobs=0, temperature=0)
    choice = reply.json()["choices"][0]
    assert choice["text"].startswith(text)
    logprobs = choice["logprobs"]
    tokens = httpx.post(engine.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    decoded = [
        len(httpx.post(engine.url + "/detokenize", json={"tokens": tokens[:i]}).json()["prompt"])
        for i in range(len(tokens))
    ]
    assert offsets[: len(tokens)] == decoded
    assert offsets[len(tokens)] == len(text)  # the first generated token starts after the echo


def test_streamed_echo_comes_first_and_matches(engine):
    args = dict(prompt="Once upon a time", echo=True, max_tokens=3, logprobs=1, temperature=0)
    whole = complete(engine, **args).json()["choices"][0]
    with httpx.stream(
        "POST",
        engine.url + "/v1/completions",
        json={"model": "tiny", "stream": True, "ignore_eos": True, **args},
        timeout=60,
    ) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"].startswith("Once upon a time")
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [t for c in chunks for t in (c["logprobs"] or {}).get("tokens", [])]
    assert streamed == whole["logprobs"]["tokens"]


def test_vllm_prompt_logprobs_field(engine):
    reply = complete(engine, prompt=[100, 200, 300], prompt_logprobs=2, max_tokens=1)
    choice = reply.json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 3
    for token_id, entry in zip([200, 300], entries[1:], strict=True):
        assert str(token_id) in entry
        ranks = sorted(item["rank"] for item in entry.values())
        assert ranks[0] == 1 and len(entry) in (2, 3)
        assert all(isinstance(item["decoded_token"], str) for item in entry.values())
    assert "logprobs" in choice and choice["logprobs"] is None  # not asked: echo is off
    plain = complete(engine, prompt="hi", max_tokens=1).json()["choices"][0]
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"prompt": [5] * 256, "echo": True, "max_tokens": 0}, "prompt", "context_length_exceeded"),
        ({"prompt": "x", "echo": True, "logprobs": 6}, "logprobs", "invalid_value"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "invalid_value"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
        ({"prompt": ["a"] * 2049}, "prompt", "unsupported_parameter"),
        ({"prompt": ["a", ""], "echo": True}, "prompt", None),
    ],
)
def test_bad_scoring_requests_are_400_naming_the_field(engine, extra, param, code):
    before = engine.get_json("/load")
    reply = complete(engine, **extra)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    after = engine.get_json("/load")
    assert after["slots_free"] == before["slots_free"] == after["slots_total"]


# ---------------------------------------------------------------- /tokenize and /detokenize


def test_tokenize_and_detokenize_in_vllm_shapes(engine):
    reply = httpx.post(
        engine.url + "/tokenize",
        json={"model": "tiny", "prompt": "Hello world", "return_token_strs": True},
    ).json()
    assert reply["count"] == len(reply["tokens"]) == len(reply["token_strs"])
    assert reply["max_model_len"] == 256
    back = httpx.post(engine.url + "/detokenize", json={"tokens": reply["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    chat = httpx.post(
        engine.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    answer = httpx.post(
        engine.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    ).json()
    assert chat["count"] == answer["usage"]["prompt_tokens"]  # the template, as a chat request
    info = httpx.get(engine.url + "/tokenizer_info").json()
    assert info["eos_token"] and info["model_max_length"] == 256 and info["chat_template"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
        ("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
        ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
        ("/tokenize", {"prompt": "x " * 300}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_tokenizer_requests_name_the_field(engine, path, body, param):
    reply = httpx.post(engine.url + path, json=body, timeout=30)
    assert reply.status_code in (400, 404), reply.text
    assert reply.json()["error"]["param"] == param
