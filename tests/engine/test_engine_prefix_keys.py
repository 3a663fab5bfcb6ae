"""The engine's /load names the prefix keys its slot rows hold (prefix-aware routing): the keys of
a request while it runs, those of its conversation with the answer once it finished, and none of
a row another request took over. Units of the bookkeeping, then a real engine process."""

from __future__ import annotations

import json
import urllib.request

import pytest

from slotserve.contracts.headers import CACHE_SALT_HEADER
from slotserve.contracts.prefix_keys import chat_chain, text_chain, with_answer
from slotserve.engine.http.prefix_rows import PrefixRows, row_keys
from tests.engine.engine_server_support import EngineProcess


def test_rows_report_their_requests_keys_and_forget_overwritten_rows():
    rows = PrefixRows()
    chain = chat_chain([{"role": "user", "content": "hi"}], "")
    rows.started(["a"], chain)
    assert rows.report([None, None]) == []  # waiting for a slot: no row, but kept
    assert rows.report(["a", None]) == list(chain.keys)
    rows.finished("a", chain, "hello")
    rows.ended(["a"])
    assert rows.report(["a", None]) == list(with_answer(chain, "hello"))
    assert rows.report(["b", None]) == []  # a's row taken by b (no keys): a is forgotten
    assert rows.report(["a", None]) == []


def test_rows_report_is_bounded():
    rows = PrefixRows(max_noted=3)
    for index in range(10):
        rows.started([f"r{index}"], text_chain(f"{index}" * 600, ""))
    assert len(rows.report([f"r{index}" for index in range(10)])) == 3
    keys = tuple(f"{index:016x}" for index in range(20))
    assert row_keys(keys, 4) == (keys[0], *keys[-3:])
    assert row_keys(keys, 1) == keys[-1:]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("prefix-keys") / "engine.log"
    proc = EngineProcess(tiny_model_dir, log, "--max-batch-size", "2").start()
    yield proc
    proc.stop()


def chat(engine: EngineProcess, messages: list[dict], salt: str | None = None) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    headers = {"Content-Type": "application/json"}
    if salt is not None:
        headers[CACHE_SALT_HEADER] = salt
    request = urllib.request.Request(
        f"{engine.url}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return str(json.loads(resp.read())["choices"][0]["message"]["content"])


def reported(engine: EngineProcess) -> set[str]:
    return set(engine.get_json("/load")["prefix_keys"])


def test_load_reports_the_conversation_with_its_answer_until_the_row_is_taken(engine):
    history = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ]
    answer = chat(engine, history, salt="tenant-a")
    chain = chat_chain(history, "tenant-a")
    keys = reported(engine)
    # The next turn's history (this answer as the assistant's message) matches in full.
    next_turn = [
        *history,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "?"},
    ]
    assert set(chat_chain(next_turn, "tenant-a").keys[:3]) <= keys
    assert set(chain.keys) <= keys
    # Another tenant's identical conversation has other keys: nothing of A's is reported as B's.
    assert not set(chat_chain(history, "tenant-b").keys) & keys
    # Two other prompts (sharing no prefix) take both rows (2 slots): A's keys leave the report.
    for word in ("alpha", "beta"):
        filler = [{"role": "system", "content": f"{word} " * 40}, {"role": "user", "content": "x"}]
        chat(engine, filler, salt="tenant-c")
    assert not set(chain.keys) & reported(engine)
