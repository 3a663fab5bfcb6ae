"""bench/prefix_routing_bench.py end to end on a tiny model: a real engine, gateway and Redis,
and figures that agree with what the engine itself counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bench import prefix_routing_bench
from bench.lib.chat_workloads import IdealCache, chat_ids, conversations, system_requests


# Once serial: twice in about seven runs of the whole suite (never alone) the engine's counters
# showed almost no hits (0.10 of the ideal: 69 of 720 reusable tokens). Reproduced beside the
# suite's start: the two first turns ran one after the other, and the second cut the first's row
# for the chat template's preamble (fixed in prefix_cache._would_cut). Since that fix it passed
# beside four CPU hogs on 2 cores and in the parallel part of the suite, so it runs there.
@pytest.mark.slow
def test_one_engine_serves_each_later_turn_from_its_history(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = ["--quick", "--model", str(tiny_model_dir), "--engines", "1", "--gateways", "1"]
    argv += ["--routings", "load", "--workloads", "chat", "--think", "0.1", "0.2"]
    argv += ["--request-timeout", "120", "--cell-timeout", "300", "--out", str(tmp_path)]
    assert prefix_routing_bench.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    (cell,) = result["cells"]["chat"]["load"]
    assert cell["completed"] == cell["sent"] == 4  # 2 conversations x 2 turns
    # Prompts tokenized here as the engine does: its usage counts the same tokens.
    assert cell["prompt_tokens_sent"] == cell["prompt_tokens_usage"] > 0
    assert cell["prefix_cache_queries"] == cell["prompt_tokens_sent"]
    # One engine of 4 rows holds both histories: its hits are (about) all the ideal.
    assert cell["ideal_share"] > 0.3
    assert 0.8 <= cell["hit_of_ideal"] <= 1.0, cell  # on a failure, say the whole cell
    assert cell["requests_per_engine"] == [4.0]
    assert cell["load_samples"] > 0 and cell["slots"] == [4]
    assert cell["max_running_over_slots"] <= 0
    assert cell["ttft_first_p50_s"] > 0 and cell["ttft_later_p50_s"] > 0


def test_workloads_share_only_what_they_should(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    convs = conversations(tokenizer, 3, 2, 300, (0.3, 2.5), seed=1)
    firsts = [chat_ids(tokenizer, [{"role": "user", "content": c.messages[0]}]) for c in convs]
    ideal = IdealCache()
    ideal.add(firsts[0])
    # Another conversation's first turn shares only the template's default system prompt.
    header = chat_ids(tokenizer, [{"role": "user", "content": ""}])
    assert ideal.reusable(firsts[1]) < len(header)
    # A later turn reuses the whole earlier prompt and its answer.
    answer = tokenizer.encode("It is about ships.", add_special_tokens=False)
    ideal.add(firsts[0] + answer)
    history = [{"role": "user", "content": convs[0].messages[0]}]
    history.append({"role": "assistant", "content": "It is about ships."})
    second = chat_ids(tokenizer, [*history, {"role": "user", "content": convs[0].messages[1]}])
    assert ideal.reusable(second) >= len(firsts[0]) + len(answer) - 1
    requests = system_requests(tokenizer, 2, 1000, 6, seed=3)
    lengths = [len(chat_ids(tokenizer, r)) for r in requests]
    assert all(1000 < n < 1100 for n in lengths)
    assert len({r[0]["content"] for r in requests}) == 2
    assert len({r[1]["content"] for r in requests}) == 6


def test_engine_flags_pass_spare_rows_and_any_other_flag() -> None:
    args = prefix_routing_bench.parse_args(
        ["--prefix-cache-rows", "12", "--engine-arg=--max-waiting", "--engine-arg=64"]
    )
    flags = prefix_routing_bench.engine_flags
    assert (
        flags(args, "prefix")
        == flags(args, "load")
        == (
            "--max-waiting",
            "64",
            "--prefix-cache-rows",
            "12",
        )
    )
    # "today": the pool before issue 29, one row per slot whatever the others get.
    assert flags(args, "today") == ("--max-waiting", "64")
    assert flags(prefix_routing_bench.parse_args([]), "prefix") == ()


def test_targets_compare_prefix_with_each_baseline_run() -> None:
    def cell(later: float, rate: float) -> dict[str, float]:
        return {
            "hit_of_ideal": 0.95,
            "ttft_later_p50_s": later,
            "ttft_all_p50_s": later,
            "requests_per_s": rate,
            "busiest_over_mean": 1.0,
            "max_running_over_slots": 0,
        }

    cells = {"today": [cell(60.0, 0.5)], "load": [cell(45.0, 0.6)], "prefix": [cell(30.0, 0.9)]}
    checks = {
        name: (round(v, 2), met)
        for name, v, met in prefix_routing_bench.target_checks("chat-wide", cells)
    }
    assert checks["later turns' TTFT p50, today / prefix >= 2"] == (2.0, True)
    assert checks["later turns' TTFT p50, load / prefix >= 2"] == (1.5, False)
    assert checks["completed req/s, prefix / load >= 1.2"] == (1.5, True)
    system = prefix_routing_bench.target_checks(
        "system", {"load": [cell(3.0, 1)], "prefix": [cell(1.0, 1)]}
    )
    assert system[0][0] == "TTFT p50, load / prefix >= 2" and system[0][2]
    assert prefix_routing_bench.target_checks("chat", {"load": [cell(1.0, 1)]}) == []
