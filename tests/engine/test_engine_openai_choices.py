"""n > 1: choices that share the prompt's prefill, one slot each, reproducible and different with
a seed; streamed with their indices; refused with a 400 naming ``n`` beyond the slots; and the
new fields through a real gateway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.engine.engine_core_support import build_sharp_tiny_model
from tests.engine.engine_server_support import EngineProcess, module_engine
from tests.support import free_port, http_ok, wait_until

SLOTS = 4
# Long enough for the prefix cache (it reuses prefixes of 16 tokens or more).
PROMPT = "Once upon a time in a land far away there lived a " * 4


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory, smollm2_dir):
    # Close logits, so that sampled choices really differ (the plain tiny model echoes).
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


engine, client = module_engine("choices", "--max-batch-size", str(SLOTS), model="sharp_model_dir")


def prefix_hits(engine: EngineProcess) -> float:
    return sum(
        value
        for (name, _), value in engine.metrics().items()
        if name.startswith("vllm:prefix_cache_hits")
    )


def test_n_choices_differ_repeat_with_a_seed_and_share_the_prefill(client, engine):
    args = dict(
        model="tiny", prompt=PROMPT, n=3, max_tokens=12, temperature=1.0, seed=11,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    hits_before = prefix_hits(engine)
    # A prompt of 300+ tokens: choices wait for choice 0's prefill only when that saves 256 or
    # more tokens (the prefix cache's rule; shorter prompts are computed side by side).
    first = client.completions.create(**{**args, "prompt": PROMPT * 6})
    hits = prefix_hits(engine) - hits_before
    texts = [choice.text for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    assert len(set(texts)) > 1, texts
    again = client.completions.create(**{**args, "prompt": PROMPT * 6})
    assert [c.text for c in again.choices] == texts
    single = client.completions.create(**{**args, "prompt": PROMPT * 6, "n": 1})
    assert single.choices[0].text == texts[0], "choice 0 samples with the seed itself"
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert first.usage.completion_tokens == 36
    # Choices 1 and 2 copied the prompt's keys and values (all but its last token) from choice
    # 0's row instead of computing them.
    assert hits >= 2 * (first.usage.prompt_tokens - 1)


def test_chat_n_streamed_with_indices_equals_the_whole_answer(client):
    args = dict(
        model="tiny", messages=[{"role": "user", "content": "hello"}], n=2, max_tokens=8,
        temperature=1.0, seed=5, logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = client.chat.completions.create(**args)
    texts = {0: "", 1: ""}
    finish = {}
    num_logprobs = {0: 0, 1: 0}
    usage = None
    for chunk in client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                num_logprobs[choice.index] += len(choice.logprobs.content)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert num_logprobs == {0: 8, 1: 8}
    assert usage is not None  # asked for with include_usage
    assert usage.completion_tokens == whole.usage.completion_tokens == 16


def test_each_choice_takes_a_slot(client, engine):
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, n=2, max_tokens=300, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    try:
        next(iter(stream))
        wait_until(lambda: engine.get_json("/load")["running"] == 2, 10, what="2 running")
        assert engine.get_json("/load")["slots_free"] == SLOTS - 2
    finally:
        stream.close()
    wait_until(lambda: engine.get_json("/load")["running"] == 0, 10, what="both aborted")


@pytest.mark.parametrize(("n", "why"), [(SLOTS + 1, "slots"), (0, "greater"), (129, "less")])
def test_n_beyond_the_slots_is_400_naming_n_before_any_slot(engine, n, why):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": n}
    reply = httpx.post(engine.url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "n" and why in error["message"]
    load = engine.get_json("/load")
    assert load["slots_free"] == SLOTS and load["waiting"] == 0


@pytest.mark.slow
def test_the_new_fields_pass_through_a_real_gateway(engine, tmp_path):
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {
                        "model": "tiny",
                        "endpoints": [engine.url],
                        "batching": {"policy": "continuous", "maxBatchSize": SLOTS},
                        "admission": {"maxQueueSize": 16, "queueTimeoutSeconds": 30},
                    }
                ]
            }
        )
    )
    port = free_port()
    slotserve = Path(sys.executable).with_name("slotserve")
    argv = [str(slotserve), "gateway", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--config", str(pools), "--log-level", "WARNING"]
    with (tmp_path / "gateway.log").open("wb") as log:
        gateway = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(f"{url}/ready"), 30, what="gateway /ready")
        via = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        direct = openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
        args: dict[str, Any] = dict(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            temperature=0, logprobs=True, top_logprobs=2, presence_penalty=0.5,
            frequency_penalty=0.5, logit_bias={"17": -5}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        through = via.chat.completions.create(**args)
        expected = direct.chat.completions.create(**args)
        assert through.choices[0].message.content == expected.choices[0].message.content
        # Same tokens and alternatives; floats may differ in the last bits (the second request
        # reads the prompt from the prefix cache instead of computing it).
        got, want = through.choices[0].logprobs.content, expected.choices[0].logprobs.content
        assert [(e.token, [t.token for t in e.top_logprobs]) for e in got] == [
            (e.token, [t.token for t in e.top_logprobs]) for e in want
        ]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-3)
        streamed = [
            entry.token
            for chunk in via.chat.completions.create(**args, stream=True)
            for choice in chunk.choices
            if choice.logprobs is not None
            for entry in choice.logprobs.content
        ]
        assert "".join(streamed) == expected.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as refused:
            via.chat.completions.create(**{**args, "top_logprobs": 2, "logprobs": False})
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["param"] == "top_logprobs"
    finally:
        gateway.terminate()
        gateway.wait(timeout=15)
