"""Penalties, logit_bias and min_tokens: equal to HF's logits processors token for token under
greedy decoding (all in one continuous batch), and through the HTTP API with the openai client."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.sequence import Sequence
from tests.engine.engine_core_support import make_engine
from tests.engine.engine_server_support import module_engine

NUM_NEW = 20


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented rule, row by row: logit - count x frequency - (count > 0) x presence,
    over the tokens generated so far (HF has no processor for these two)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row in range(input_ids.shape[0]):
            counts = torch.bincount(input_ids[row, self.prompt_len :], minlength=scores.shape[1])
            counts = counts[: scores.shape[1]].to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    # The tiny model repeats itself ("fox fox fox"), so every penalty changes its answer.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: stop tokens come per case
    return model


def hf_reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """HF generate() with HF's processors, in the engine's (vLLM's) order."""
    n = len(prompt)
    processors: list[LogitsProcessor] = []
    if params.min_tokens:
        processors.append(
            MinNewTokensLengthLogitsProcessor(n, params.min_tokens, list(params.stop_token_ids))
        )
    if params.logit_bias:
        bias: list[list[list[int] | float]] = [
            [[token_id], value] for token_id, value in params.logit_bias.items()
        ]
        processors.append(SequenceBiasLogitsProcessor(bias))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        processors.append(OpenAIPenalties(n, params.frequency_penalty, params.presence_penalty))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, n, dtype=torch.long),
            max_new_tokens=params.max_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=list(params.stop_token_ids) or None,
            logits_processor=LogitsProcessorList(processors),
        )
    return out[0, n:].tolist()


def test_penalties_equal_hf_logits_processors_token_for_token(tiny_model_dir, reference_model):
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 49_000, (5 + 4 * i,), generator=generator).tolist() for i in range(8)
    ]
    base = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    plain = [hf_reference(reference_model, p, base) for p in prompts]
    echo = [out[0] for out in plain]  # the tiny model's output echoes a token many times
    cases: dict[str, dict[str, Any]] = {
        "plain": {},
        "repetition": {"repetition_penalty": 2.0},
        "repetition_below_one": {"repetition_penalty": 0.7, "logit_bias": {echo[2]: -60.0}},
        "frequency": {"frequency_penalty": 1.5},
        # A bias against the echo makes the next-best tokens compete, where presence matters.
        "presence": {"presence_penalty": 2.0, "logit_bias": {echo[4]: -30.0}},
        "negative": {
            "frequency_penalty": -0.5,
            "presence_penalty": -1.0,
            "repetition_penalty": 2.0,
        },
        # The plain answer's first token is forbidden, another pushed up.
        "logit_bias": {"logit_bias": {echo[6]: -100.0, 500: 30.0}},
        # Without min_tokens the answer would stop at its 1st token (a stop token).
        "min_tokens": {
            "stop_token_ids": [echo[7]],
            "min_tokens": 8,
            "repetition_penalty": 1.2,
            "presence_penalty": 0.5,
            "logit_bias": {echo[7]: -25.0},
        },
    }
    params = [base.model_copy(update=extra) for extra in cases.values()]
    engine = make_engine(tiny_model_dir, max_batch_size=4, max_batched_tokens=24)
    # One continuous batch of mixed parameters: 4 slots, 8 requests, arrivals staggered.
    seqs: list[Sequence] = []
    for step in range(400):
        if step % 3 == 0 and len(seqs) < len(prompts):
            i = len(seqs)
            seqs.append(engine.add_request(f"r{i}", prompts[i], params[i]))
        engine.step()
        if len(seqs) == len(prompts) and not engine.has_unfinished():
            break
    for name, seq, prompt, p, plain_out in zip(cases, seqs, prompts, params, plain, strict=True):
        expected = hf_reference(reference_model, prompt, p)
        assert seq.generated_token_ids == expected, name
        if name != "plain":
            assert expected != plain_out, f"{name} must change the answer to prove anything"
    assert len(seqs[7].generated_token_ids) >= 8


# -------------------------------------------------------------------- a real engine process


engine, client = module_engine("penalties", "--max-batch-size", "4")


ARGS = dict(model="tiny", prompt="the quick brown fox", max_tokens=12, temperature=0, logprobs=0)


def tokens(reply) -> list[str]:
    return reply.choices[0].logprobs.tokens


def test_penalties_and_bias_through_the_openai_client(client, tiny_model_dir):
    plain = tokens(client.completions.create(**ARGS, extra_body={"ignore_eos": True}))
    assert len(set(plain)) < len(plain), "the tiny model repeats itself: penalties must show"
    penalized = tokens(
        client.completions.create(
            **ARGS,
            frequency_penalty=2.0,
            presence_penalty=2.0,
            extra_body={"ignore_eos": True, "repetition_penalty": 2.0},
        )
    )
    assert len(set(penalized)) > len(set(plain))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    forced = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    biased = client.completions.create(**ARGS, logit_bias={str(forced): 100})
    assert tokens(biased) == [tokenizer.decode([forced])] * 12
    repeated = tokenizer.encode(plain[0], add_special_tokens=False)[0]  # " fox", again and again
    stop_early = {"stop_token_ids": [repeated]}
    assert client.completions.create(**ARGS, extra_body=stop_early).usage.completion_tokens == 1
    held = client.completions.create(**ARGS, extra_body={**stop_early, "min_tokens": 6})
    assert held.usage.completion_tokens >= 6
    assert held.choices[0].finish_reason in {"stop", "length"}
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logit_bias={str(forced): 100},
        extra_body={"repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert chat.choices[0].message.content == tokenizer.decode([forced]) * 4


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_bad_penalties_are_400_naming_the_field_before_any_slot(engine, extra, param):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, **extra}
    reply = httpx.post(engine.url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    load = engine.get_json("/load")
    assert load["slots_free"] == load["slots_total"] and load["waiting"] == 0
