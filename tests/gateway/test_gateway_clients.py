"""The clients people point at a server (issue 28), against a real SmolLM2 engine and through the
gateway in front of it: lm-evaluation-harness in loglikelihood and generate_until modes (scores
checked against transformers on the same weights), the Responses API with the official openai
client, and vLLM's /tokenize and /detokenize.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from openai.types.responses import ResponseCompletedEvent, ResponseIncompleteEvent

from tests.gateway.gateway_support import SLOTSERVE, Proc, Spawner, pool, write_pools
from tests.gateway.lm_eval_support import LmEvalUnavailableError, lm_eval_venv, run_lm_eval
from tests.support import free_port, http_ok, wait_until

pytestmark = pytest.mark.slow

MC_TASK, GEN_TASK = "slotserve_mc", "slotserve_gen"


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    """One SmolLM2 engine (fp32, 4 slots) and one gateway (in-process admission) before it."""
    spawner = Spawner(tmp_path_factory.mktemp("clients"))
    try:
        port = free_port()
        argv = [
            str(SLOTSERVE), "engine", "--model", str(smollm2_dir), "--served-model-name",
            "smollm2", "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
            "--max-batch-size", "4", "--max-model-len", "512", "--dtype", "float32",
        ]  # fmt: skip
        engine = spawner._start(Proc, "engine", argv, port)
        try:
            wait_until(lambda: http_ok(f"{engine.url}/ready"), 180, interval=0.2, what="engine")
        except TimeoutError:
            raise AssertionError(f"engine did not start:\n{engine.logs()}") from None
        pools = write_pools(spawner.tmp_path / "pools.yaml", [pool("smollm2", [engine.url])])
        gateway = spawner.gateway(pools)
        yield {"engine": engine.url, "gateway": gateway.url}
    finally:
        spawner.stop_all()


@pytest.fixture(scope="module")
def lm_eval():
    try:
        return lm_eval_venv()
    except LmEvalUnavailableError as error:
        pytest.skip(f"lm-evaluation-harness cannot be installed here: {error}")


# ----------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    model.eval()
    return tokenizer, model


# transformers' answers by question: both lm-eval runs (engine, gateway) ask the same ones.
HF_ANSWERS: dict[tuple[object, ...], Any] = {}


def hf_loglikelihood(hf, context: str, continuation: str) -> tuple[float, int]:
    """lm-eval's own split of (context, continuation) into tokens, scored by transformers."""
    key = ("loglikelihood", context, continuation)
    if key not in HF_ANSWERS:
        HF_ANSWERS[key] = _hf_loglikelihood(hf, context, continuation)
    return HF_ANSWERS[key]


def _hf_loglikelihood(hf, context: str, continuation: str) -> tuple[float, int]:
    tokenizer, model = hf
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    num_context = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    total = sum(float(logprobs[i - 1, whole[i]]) for i in range(num_context, len(whole)))
    return total, len(whole) - num_context


def hf_greedy(hf, prompt: str, until: list[str], max_new: int) -> str:
    key = ("greedy", prompt, tuple(until), max_new)
    if key not in HF_ANSWERS:
        HF_ANSWERS[key] = _hf_greedy(hf, prompt, until, max_new)
    return HF_ANSWERS[key]


def _hf_greedy(hf, prompt: str, until: list[str], max_new: int) -> str:
    tokenizer, model = hf
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    text = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    for stop in until:
        text = text.split(stop)[0]
    return text


def samples(folder: Path, task: str) -> list[dict]:
    (path,) = folder.glob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- lm-eval


@pytest.mark.timeout(1800)  # the first run builds lm-eval's venv (minutes, once per machine)
@pytest.mark.parametrize(
    ("target", "tokenizer"),
    [("engine", "huggingface"), ("gateway", "remote")],  # remote: /tokenizer_info, /tokenize
)
def test_lm_eval_scores_equal_transformers(
    stack, lm_eval, hf, smollm2_dir, tmp_path, target, tokenizer
):
    base_url = f"{stack[target]}/v1/completions"
    model_args = (
        f"model=smollm2,base_url={base_url},tokenizer_backend={tokenizer},"
        f"tokenizer={smollm2_dir},num_concurrent=2,max_retries=1"
    )
    folder = run_lm_eval(lm_eval, model_args, tmp_path / "out", f"{MC_TASK},{GEN_TASK}")
    (results_file,) = folder.glob("results_*.json")
    results = json.loads(results_file.read_text())["results"]

    # loglikelihood: every (question, choice) equals transformers' to 1e-3 per token.
    hf_correct = []
    worst_gap = 0.0  # per token, printed for closing notes (pytest -s)
    for sample in samples(folder, MC_TASK):
        doc = sample["doc"]
        ours = [float(resp[0][0]) for resp in sample["resps"]]
        theirs = [
            hf_loglikelihood(hf, args["arg_0"], args["arg_1"])
            for args in sample["arguments"].values()
        ]
        for got, (expected, num_tokens) in zip(ours, theirs, strict=True):
            assert got == pytest.approx(expected, abs=1e-3 * num_tokens), (doc, ours, theirs)
            worst_gap = max(worst_gap, abs(got - expected) / num_tokens)
        best = max(range(len(theirs)), key=lambda i: theirs[i][0])
        hf_correct.append(float(best == doc["answer"]))
        assert sample["acc"] == hf_correct[-1]
    assert results[MC_TASK]["acc,none"] == pytest.approx(sum(hf_correct) / len(hf_correct))

    # generate_until: greedy answers equal transformers' greedy answers.
    hf_matches = []
    for sample in samples(folder, GEN_TASK):
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        greedy = hf_greedy(hf, prompt, ["\n", "."], 8)
        assert sample["resps"][0][0] == greedy, (prompt, sample["resps"], greedy)
        hf_matches.append(sample["exact_match"])
    assert results[GEN_TASK]["exact_match,none"] == pytest.approx(sum(hf_matches) / len(hf_matches))
    print(
        f"lm-eval via {target}: {MC_TASK} acc {results[MC_TASK]['acc,none']:.4f} "
        f"(HF {sum(hf_correct) / len(hf_correct):.4f}, {len(hf_correct)} questions, worst "
        f"loglikelihood gap {worst_gap:.2e} a token); {GEN_TASK} exact_match "
        f"{results[GEN_TASK]['exact_match,none']:.4f} (HF {sum(hf_matches) / len(hf_matches):.4f})"
    )


# ----------------------------------------------------------------------------- Responses API


@pytest.mark.parametrize("target", ["engine", "gateway"])
def test_responses_with_the_openai_client(stack, target):
    client = openai.OpenAI(base_url=f"{stack[target]}/v1", api_key="unused", max_retries=0)
    reply = client.responses.create(
        model="smollm2",
        instructions="Answer in one word.",
        input="What is the capital of France?",
        max_output_tokens=12,
        temperature=0,
    )
    assert reply.object == "response" and reply.status in ("completed", "incomplete")
    assert reply.output_text and reply.output[0].type == "message"
    assert reply.usage is not None
    assert reply.usage.output_tokens <= 12 and reply.usage.input_tokens > 0
    events = list(
        client.responses.create(
            model="smollm2",
            instructions="Answer in one word.",
            input=[{"role": "user", "content": "What is the capital of France?"}],
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == reply.output_text  # greedy: the stream says what the whole answer said
    assert isinstance(events[-1], ResponseCompletedEvent | ResponseIncompleteEvent)
    assert events[-1].response.output_text == text
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    # The tool leaves out "strict", which openai's types require and the API does not.
    with client.responses.stream(  # type: ignore[call-overload]
        model="smollm2",
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    ) as stream:
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="smollm2", input="x", previous_response_id="resp_1")
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["param"] == "previous_response_id"


# ----------------------------------------------------------------------------- /tokenize


def test_tokenize_routes_by_model_through_the_gateway(stack):
    gateway = stack["gateway"]
    direct = httpx.post(f"{stack['engine']}/tokenize", json={"prompt": "Hello world"}).json()
    routed = httpx.post(
        f"{gateway}/tokenize", json={"model": "smollm2", "prompt": "Hello world"}
    ).json()
    assert routed == direct
    back = httpx.post(f"{gateway}/detokenize", json={"tokens": direct["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    assert httpx.get(f"{gateway}/tokenizer_info").json()["eos_token"]
    unknown = httpx.post(f"{gateway}/tokenize", json={"model": "other", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
