"""A batch of prompts takes one engine slot per prompt and choice (P x n), through a real engine.

``/v1/completions`` with ``prompt`` as a list of P prompts (strings or token-id lists) and ``n``
runs P x n sequences in the engine; the gateway counted only ``n`` before, so two such requests
put four sequences on a two-slot engine (two waited inside it).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.gateway.gateway_support import pool, write_pools
from tests.gateway.test_gateway_e2e_engines import NUM_SLOTS, LoadSampler, start_engine, wait_ready

pytestmark = pytest.mark.slow


async def test_batched_prompts_take_a_slot_per_prompt_and_choice(spawn, tiny_model_dir, tmp_path):
    engine = wait_ready(start_engine(spawn, tiny_model_dir))
    gateway = spawn.gateway(write_pools(tmp_path / "pools.yaml", [pool("tiny", [engine])]))
    sampler = LoadSampler([engine])
    sampler.start()
    url = f"{gateway.url}/v1/completions"
    batches: list[object] = [["Hello", "Count to three."], [[1, 2, 3], [4, 5]]]
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            answers = await asyncio.gather(
                *(
                    client.post(
                        url,
                        json={"model": "tiny", "prompt": batches[i % 2], "max_tokens": 16},
                    )
                    for i in range(8)
                ),
                client.post(
                    url, json={"model": "tiny", "prompt": [7, 8, 9], "n": 2, "max_tokens": 16}
                ),
            )
            too_many = await client.post(
                url, json={"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 4}
            )
    finally:
        sampler.stop.set()
        sampler.join(timeout=5)
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"]) == 2
    assert max(sampler.max_running.values()) <= NUM_SLOTS
    assert max(sampler.max_waiting.values()) == 0  # never more sequences than slots
    # Three prompts need three slots; the pool's engine has two: refused, naming the field.
    assert too_many.status_code == 400, too_many.text
    assert too_many.json()["error"]["param"] == "prompt"
