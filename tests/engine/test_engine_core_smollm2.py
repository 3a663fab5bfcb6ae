"""The real SmolLM2-135M-Instruct under continuous batching, compared with HF generate().

Batched float arithmetic can flip near-ties, so like vLLM's model tests this accepts outputs that
agree up to a point where both tokens are among the reference's top-5 for the shared prefix.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from slotserve.engine.core.params import SamplingParams
from tests.engine.engine_core_support import make_engine, run_staggered

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
    "Who wrote Hamlet?",
    "Give me a tip for learning Python, with an example of a list comprehension.",
]
NUM_NEW = 16


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return make_engine(smollm2_dir, max_batch_size=4, max_batched_tokens=64)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    # Like ignore_eos in the engine: neither stop at nor suppress the end-of-sequence token.
    model.generation_config.eos_token_id = None
    return model


def chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_capital_of_france(engine):
    prompt = chat_ids(engine.tokenizer, QUESTIONS[0])
    result = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert result.text == "The capital of France is Paris."
    assert result.finish_reason == "stop"  # the model's <|im_end|> ended it


def test_batched_outputs_close_to_generate_alone(engine, reference):
    prompts = [chat_ids(engine.tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    # Staggered: two requests join every 3 steps; 4 slots, 64 tokens a step (chunked prefill).
    seqs = run_staggered(engine, prompts, params, every=3, per=2)
    num_identical = 0
    for question, seq, prompt in zip(QUESTIONS, seqs, prompts, strict=True):
        ours = seq.generated_token_ids
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NUM_NEW,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        theirs = out.sequences[0, len(prompt) :].tolist()
        if ours == theirs:
            num_identical += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        top5 = torch.topk(out.scores[k][0], 5).indices.tolist()
        assert ours[k] in top5 and theirs[k] in top5, (question, k, top5)
    assert num_identical >= len(prompts) // 2  # near-ties are the exception, not the rule
