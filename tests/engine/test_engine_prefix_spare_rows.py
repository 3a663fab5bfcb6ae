"""KV rows beyond the slots (``prefix_cache_rows``): finished prefixes outlive later sequences.

Units of the bookkeeping (pure Python), then the tiny models in process: the same greedy tokens
as one row per slot, never more than the slots running, a conversation's next turn reusing a row
that more than the slots' worth of other requests went through, /load naming every row's keys,
and the settings and memory that refuse spare rows.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from slotserve.contracts.prefix_keys import chat_chain
from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.kv_cache import KVCacheManager
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.sequence import Sequence
from slotserve.engine.settings import EngineSettings
from tests.engine.engine_core_support import (
    build_sharp_tiny_model,
    make_engine,
    model_runner,
    served_in_process,
)
from tests.engine.test_engine_isolation_memory import MiB, fake_host, write


def seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams(max_tokens=4), 0.0)


def run_through(kv: KVCacheManager, request_id: str, token_ids: list[int]) -> tuple[int, int]:
    """Admit, compute the whole prompt, finish (the row keeps the prompt): its row and the
    tokens it reused."""
    s = seq(request_id, token_ids)
    kv.allocate(s)
    assert s.slot is not None
    row, reused = s.slot, s.num_computed_tokens
    s.num_computed_tokens = s.num_tokens
    kv.free(s)
    return row, reused


def prompt(base: int, length: int = 40) -> list[int]:
    return list(range(base, base + length))


def test_spare_rows_run_no_more_than_the_slots():
    kv = KVCacheManager(num_slots=2, num_tokens_total=4000, enable_prefix_caching=True, num_rows=5)
    first, second = seq("a", prompt(100)), seq("b", prompt(200))
    kv.allocate(first)
    kv.allocate(second)
    assert kv.num_free_slots == 0
    assert not kv.can_allocate(seq("c", prompt(300)))
    kv.free(first)
    assert kv.num_free_slots == 1 and kv.can_allocate(seq("c", prompt(300)))
    with pytest.raises(ValueError, match="num_rows"):
        KVCacheManager(num_slots=3, num_tokens_total=100, num_rows=2)


@pytest.mark.parametrize(("num_rows", "reused"), [(2, 0), (4, 40)])
def test_a_finished_row_survives_more_than_the_slots_worth_of_later_sequences(num_rows, reused):
    kv = KVCacheManager(
        num_slots=2, num_tokens_total=4000, enable_prefix_caching=True, num_rows=num_rows
    )
    run_through(kv, "turn-1", prompt(100))
    for index in range(2):  # as many other conversations as there are slots
        run_through(kv, f"other-{index}", prompt(1000 * (index + 2)))
    turn_2 = seq("turn-2", [*prompt(100), 7, 8, 9])
    kv.allocate(turn_2)
    assert turn_2.num_computed_tokens == reused
    assert kv.num_prefix_hit_tokens == reused


def test_the_least_recently_used_free_row_is_evicted_first():
    kv = KVCacheManager(num_slots=1, num_tokens_total=4000, enable_prefix_caching=True, num_rows=3)
    slots = {name: run_through(kv, name, prompt(base))[0] for name, base in
             (("p0", 100), ("p1", 200), ("p2", 300))}  # fmt: skip
    assert sorted(slots.values()) == [0, 1, 2]  # empty rows are taken before any is evicted
    # p0 is used again (its row taken in place): now p1 is the least recently used.
    assert run_through(kv, "p0-again", [*prompt(100), 5]) == (slots["p0"], 40)
    assert run_through(kv, "new-1", prompt(400)) == (slots["p1"], 0)
    # p2 still hits, though two sequences came after it on the one slot.
    assert run_through(kv, "p2-again", [*prompt(300), 6]) == (slots["p2"], 40)
    assert run_through(kv, "new-2", prompt(500)) == (slots["p0"], 0)
    assert kv.prefix_cache is not None
    assert kv.prefix_cache.row_requests[slots["p1"]] == "new-1"


@pytest.mark.parametrize(("num_rows", "kept"), [(1, False), (3, True)])
def test_a_shared_prefix_is_copied_out_of_a_longer_row_when_rows_are_spare(num_rows, kept):
    """Two conversations under one system prompt: with spare rows the second copies the system
    prompt into a row of its own, so the first's history survives for its next turn."""
    system = prompt(100, 50)
    kv = KVCacheManager(
        num_slots=1, num_tokens_total=4000, enable_prefix_caching=True, num_rows=num_rows
    )
    first_row, _ = run_through(kv, "a-1", [*system, *prompt(500, 30)])
    second = seq("b-1", [*system, *prompt(700, 30)])
    copies = kv.allocate(second)
    assert second.num_computed_tokens == 50
    if kept:
        assert second.slot != first_row
        assert [(c.src_slot, c.dst_slot, c.num_tokens) for c in copies] == [
            (first_row, second.slot, 50)
        ]
    else:
        assert (second.slot, copies) == (first_row, ())
    second.num_computed_tokens = second.num_tokens
    kv.free(second)
    _, reused = run_through(kv, "a-2", [*system, *prompt(500, 30), 9])
    assert reused == (80 if kept else 50)


def test_copying_a_prefix_every_row_shares_keeps_the_coldest_row_the_next_to_go():
    """A chat template's system prompt opens every row: each new conversation copies it into an
    empty row from the most recently used row that holds it, so the row nobody came back to (a
    warm-up's) is still the first evicted once no row is empty, not a conversation's history."""
    system = prompt(100, 20)
    kv = KVCacheManager(num_slots=1, num_tokens_total=8000, enable_prefix_caching=True, num_rows=4)
    warm, _ = run_through(kv, "warm-up", [*system, *prompt(900, 5)])
    histories = {name: [*system, *prompt(base, 30)] for name, base in
                 (("a", 300), ("b", 500), ("c", 700))}  # fmt: skip
    for name, ids in histories.items():
        assert run_through(kv, f"{name}-1", ids)[1] == 20  # the system prompt, copied
    row, _ = run_through(kv, "d-1", [*system, *prompt(1100, 30)])
    assert row == warm
    for name, ids in histories.items():  # every conversation's next turn finds its history
        assert run_through(kv, f"{name}-2", [*ids, 9])[1] == 50, name


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, smollm2_dir):
    return build_sharp_tiny_model(tmp_path_factory.getbasetemp() / "sharp-tiny", smollm2_dir)


def tokens(num: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5000, 49_000, (num,), generator=generator).tolist()


def conversations() -> list[list[int]]:
    """Six conversations of two turns, every first turn before any second: on 2 slots with a row
    each, the first turns are all evicted by the time the second turns come."""
    firsts = [tokens(60, seed) for seed in range(6)]
    return [*firsts, *([*first, *tokens(8, 100 + index)] for index, first in enumerate(firsts))]


def run_engine(model_dir: Path, **settings) -> tuple[list[list[int]], int, int]:
    """Greedy outputs, prefix-cache hit tokens, and the most sequences running at once."""
    engine = make_engine(model_dir, max_batch_size=2, **settings)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seqs = []
    most_running = 0
    for index, token_ids in enumerate(conversations()):
        seqs.append(engine.add_request(f"r{index}", token_ids, params))
        for _ in range(3):  # a new request every third step: some wait, some find a free slot
            engine.step()
            most_running = max(most_running, len(engine.scheduler.running))
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
    assert not engine.has_unfinished(), "the engine did not finish"
    return (
        [s.generated_token_ids for s in seqs],
        engine.stats().prefix_cache_hits_total,
        most_running,
    )


@pytest.mark.parametrize("decode_step", ["classic", "static"])
def test_spare_rows_give_the_same_tokens_and_more_hits(sharp_dir, decode_step):
    one_per_slot, hits_without, _ = run_engine(sharp_dir, decode_step=decode_step)
    spare, hits_with, most_running = run_engine(
        sharp_dir, decode_step=decode_step, prefix_cache_rows=8
    )
    print(f"hits: {hits_without} with one row per slot, {hits_with} with 8 rows")
    assert spare == one_per_slot
    assert all(len(out) == 6 for out in spare)
    assert most_running == 2  # the slots ran full, never past them
    # Every second turn found its first turn's row (60 tokens each), with 8 rows for 6
    # conversations; with 2 rows, hardly any did.
    assert hits_with >= 6 * 60
    assert hits_without < 2 * 60


def test_the_runner_holds_the_rows_and_decodes_the_slots(sharp_dir):
    engine = make_engine(sharp_dir, max_batch_size=2, prefix_cache_rows=5, decode_step="static")
    runner = model_runner(engine)
    assert (runner.num_slots, runner.max_rows) == (5, 2)
    static = runner.static
    assert static is not None and static.row_buckets == (1, 2)  # no graphs for spare rows
    stats = engine.stats()
    assert (stats.num_slots_total, stats.num_slots_free, stats.num_kv_rows) == (2, 2, 5)
    assert engine.limits.num_slots == 2


async def test_load_reports_the_keys_and_the_empty_rows_of_spare_rows(tiny_model_dir):
    rows = {"max_batch_size": 1, "prefix_cache_rows": 3, "max_model_len": 256}
    async with served_in_process(tiny_model_dir, **rows) as client:
        histories = [[{"role": "user", "content": f"Question {index}: name a colour."}]
                     for index in range(3)]  # fmt: skip
        empty = [(await (await client.get("/load")).json())["prefix_rows_free"]]
        idle = [(await (await client.get("/load")).json())["prefix_row_idle_ms"]]
        for history in histories:  # one slot: each finishes before the next starts
            resp = await client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": history, "max_tokens": 2, "temperature": 0},
            )
            assert resp.status == 200, await resp.text()
            if history is histories[0]:
                first_done = time.monotonic()
            load = await (await client.get("/load")).json()
            empty.append(load["prefix_rows_free"])
            idle.append(load["prefix_row_idle_ms"])
        # Each conversation took an empty row (the gateway places new prefixes by this count).
        assert empty == [3, 2, 1, 0]
        # While a row is empty it is the next to go (idle 0); then the least recently used is:
        # the first conversation's, unused since it finished, and older by the moment.
        assert idle[:3] == [0, 0, 0]
        await asyncio.sleep(0.2)
        later = (await (await client.get("/load")).json())["prefix_row_idle_ms"]
        assert 0 < idle[3] < later <= (time.monotonic() - first_done) * 1000 + 50
        load = await (await client.get("/load")).json()
        assert (load["slots_total"], load["prefix_cache_rows"]) == (1, 3)
        keys = set(load["prefix_keys"])
        for history in histories:  # all three conversations, though one slot served them
            assert chat_chain(history, "").keys[0] in keys


def test_spare_rows_below_the_slots_or_without_the_cache_are_refused():
    with pytest.raises(ValidationError, match="at least max_batch_size"):
        EngineSettings(max_batch_size=4, prefix_cache_rows=3)
    with pytest.raises(ValidationError, match="needs enable_prefix_caching"):
        EngineSettings(max_batch_size=4, prefix_cache_rows=8, enable_prefix_caching=False)
    with pytest.raises(ValidationError):
        EngineSettings(prefix_cache_rows=10**9)
    assert EngineSettings(max_batch_size=4, prefix_cache_rows=0).num_kv_rows == 4
    assert EngineSettings(max_batch_size=4, prefix_cache_rows=4).num_kv_rows == 4


def test_the_cli_refuses_spare_rows_below_the_slots(capsys):
    from slotserve.engine.cli import main

    assert main(["--max-batch-size", "4", "--prefix-cache-rows", "2", "--port", "1"]) == 2
    assert (
        "prefix_cache_rows (2) must be 0 or at least max_batch_size (4)" in capsys.readouterr().err
    )


def test_spare_rows_that_do_not_fit_the_memory_are_refused(tmp_path, tiny_model_dir):
    """The tiny model's KV is 512 bytes a token: 1 MiB of headroom at fraction 0.5 holds 4 rows
    of 256 positions. 2 slots with 4 rows start; 5 rows are refused with one line."""
    from slotserve.engine.core.model.loader import build_runner

    sources = fake_host(tmp_path, "0::/\n")
    write(sources.cgroup_root, memory__max=str(MiB + 4096), memory__current="4096")

    def settings(rows: int) -> EngineSettings:
        return EngineSettings(
            model=str(tiny_model_dir),
            device="cpu",
            max_batch_size=2,
            max_model_len=256,
            num_threads=1,
            prefix_cache_rows=rows,
        )

    runner, _tokenizer, kv_tokens = build_runner(settings(4), str(tiny_model_dir), sources)
    assert (runner.num_slots, runner.max_rows, kv_tokens) == (4, 2, 2 * 256)
    with pytest.raises(UnsupportedSettingError) as info:
        build_runner(settings(5), str(tiny_model_dir), sources)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("prefix_cache_rows 5 needs 1 MiB of KV") and "(4 rows)" in message
