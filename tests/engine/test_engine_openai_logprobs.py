"""logprobs / top_logprobs: the processed-logprobs convention, OpenAI's shapes, streaming, 400s."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from slotserve.engine.core.detokenizer import TokenTexts
from slotserve.engine.core.logprobs import MASKED_LOGPROB, SampledLogprobs
from slotserve.engine.core.model.sampling import sample
from slotserve.engine.core.params import SamplingParams
from tests.engine.engine_core_support import engine_tokenizer
from tests.engine.engine_server_support import module_engine

# ------------------------------------------------------------------------------ the sampler


def draw(logits: torch.Tensor, *params: SamplingParams) -> list[SampledLogprobs | None]:
    generators: list[torch.Generator | None] = [
        torch.Generator().manual_seed(i) for i in range(len(params))
    ]
    return sample(logits, list(params), generators, torch.Generator().manual_seed(9)).logprobs


def test_logprobs_are_those_of_the_distribution_sampled_from():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=3),  # greedy: no temperature
        SamplingParams(temperature=0.5, logprobs=2, seed=1),  # after temperature
        SamplingParams(temperature=1.0, top_k=2, logprobs=4, seed=2),  # renormalised over 2
        SamplingParams(temperature=1.0),  # did not ask
    ]
    greedy, tempered, top_k, none = draw(logits, *params)
    assert greedy is not None and tempered is not None and top_k is not None
    assert none is None
    expected = logits[0].log_softmax(-1)
    assert greedy.token_id == int(logits[0].argmax())
    assert greedy.logprob == pytest.approx(float(expected.max()), abs=1e-5)
    assert [t for t, _ in greedy.top] == logits[0].topk(3).indices.tolist()
    at_half = (logits[1] / 0.5).log_softmax(-1)
    assert tempered.logprob == pytest.approx(float(at_half[tempered.token_id]), abs=1e-5)
    assert len(tempered.top) == 2
    best_two = logits[2].topk(2)
    assert top_k.token_id in best_two.indices.tolist()
    renormalised = best_two.values.log_softmax(-1)
    assert [lp for _, lp in top_k.top[:2]] == pytest.approx(renormalised.tolist(), abs=1e-5)
    assert [lp for _, lp in top_k.top[2:]] == [-math.inf, -math.inf]  # masked: probability 0


def test_masked_alternatives_are_written_as_vllm_does(smollm2_dir):
    texts = TokenTexts(engine_tokenizer(smollm2_dir))
    decoded = texts.decode(SampledLogprobs(504, -0.5, ((504, -0.5), (7, -math.inf))))
    assert decoded.top[1][1] == MASKED_LOGPROB
    assert decoded.token == texts(504)


# -------------------------------------------------------------------- a real engine process


engine, client = module_engine("logprobs", "--max-batch-size", "4")


CHAT = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}])
GREEDY = dict(temperature=0, max_tokens=6, extra_body={"ignore_eos": True})


def test_chat_logprobs_in_openai_shape(client):
    reply = client.chat.completions.create(**CHAT, **GREEDY, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == pytest.approx(
            (entry.token, entry.logprob)
        )
    plain = client.chat.completions.create(**CHAT, **GREEDY)
    assert plain.choices[0].logprobs is None
    only = client.chat.completions.create(**CHAT, **GREEDY, logprobs=True)
    assert [e.top_logprobs for e in only.choices[0].logprobs.content] == [[]] * 6


def test_chat_stream_carries_the_same_logprobs(client):
    whole = client.chat.completions.create(**CHAT, **GREEDY, logprobs=True, top_logprobs=2)
    stream = client.chat.completions.create(
        **CHAT, **GREEDY, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(e.token, e.top_logprobs) for e in streamed] == [
        (e.token, e.top_logprobs) for e in whole.choices[0].logprobs.content
    ]


def test_completion_logprobs_in_openai_shape_and_streamed(client):
    args = dict(model="tiny", prompt="Once upon a time", logprobs=2, **GREEDY)
    reply = client.completions.create(**args)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert len(logprobs.token_logprobs) == 6
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert logprobs.text_offset == offsets
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert top[token] == pytest.approx(logprob)  # the sampled token is listed, as vLLM
        assert 1 <= len(top) <= 3
    chunks = list(client.completions.create(**args, stream=True))
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == logprobs.tokens
    offsets_streamed = [
        o
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets_streamed == offsets


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
    ],
)
def test_bad_logprobs_are_400_naming_the_field_before_any_slot(engine, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body.update(
        {"messages": CHAT["messages"]} if "chat" in path else {"prompt": "Once upon a time"}
    )
    before = engine.get_json("/load")
    reply = httpx.post(engine.url + path, json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    after = engine.get_json("/load")
    assert after["slots_free"] == before["slots_free"] == after["slots_total"]
    assert after["running"] == after["waiting"] == 0
