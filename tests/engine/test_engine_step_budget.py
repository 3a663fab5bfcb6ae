"""The per-step token budget (chunked prefill): the device's default when the pool leaves it unset
(1,024 tokens on CPU, where a step's prompts get their first tokens when the whole step ends),
the setting when given."""

from __future__ import annotations

import pytest

from slotserve.engine.core.params import SamplingParams
from tests.engine.engine_core_support import make_engine

# Three prompts of 600 tokens, none a prefix of another (a shared prefix would wait for its
# first computation: the prefix cache, not the budget).
PROMPTS = [list(range(5 + i, 605 + i)) for i in range(3)]


@pytest.mark.parametrize(
    ("setting", "budget", "first_tokens"),
    [
        (None, 1024, [1, 0, 0]),  # 600 + 424 of the second prompt; the rest next step
        (2048, 2048, [1, 1, 1]),  # all three prompts in one step
        (256, 256, [0, 0, 0]),
    ],
)
def test_a_cpu_engine_prefills_its_budget_a_step(tiny_model_dir, setting, budget, first_tokens):
    engine = make_engine(
        tiny_model_dir, max_batch_size=4, max_model_len=1024, max_batched_tokens=setting
    )
    assert engine.stats().max_batched_tokens == budget
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", prompt, params) for i, prompt in enumerate(PROMPTS)]
    engine.step()
    assert sum(seq.num_computed_tokens for seq in seqs) == min(budget, 1800)
    assert [seq.num_generated_tokens for seq in seqs] == first_tokens
    while engine.has_unfinished():
        engine.step()
    assert all(seq.num_generated_tokens == 2 for seq in seqs)
