"""The real SmolLM2-135M-Instruct behind the HTTP API answers a factual question correctly."""

from __future__ import annotations

import openai
import pytest

from tests.engine.engine_server_support import EngineProcess


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2_engine: EngineProcess) -> None:
    client = openai.OpenAI(base_url=smollm2_engine.url + "/v1", api_key="x", max_retries=0)
    answer = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    content = answer.choices[0].message.content
    assert content is not None and "Paris" in content, answer
    assert answer.choices[0].finish_reason in {"stop", "length"}
