"""The prefix cache matches only within a cache salt (the gateway's tenant, a client's vLLM
``cache_salt``): bookkeeping units, then a real engine process counting its prefix-cache hits."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from slotserve.contracts.headers import CACHE_SALT_HEADER
from slotserve.engine.core.kv_cache import KVCacheManager
from slotserve.engine.core.params import MAX_CACHE_SALT_CHARS, SamplingParams
from slotserve.engine.core.prefix_cache import MIN_WAIT_TOKENS
from slotserve.engine.core.sequence import Sequence
from slotserve.engine.http.openai_api import cache_salt_of
from tests.engine.engine_server_support import EngineProcess

SYSTEM = list(range(1000, 1100))  # a 100-token shared prompt


def seq(request_id: str, token_ids: list[int], salt: str | None) -> Sequence:
    return Sequence(request_id, token_ids, SamplingParams(max_tokens=4, cache_salt=salt), 0.0)


def computed(s: Sequence) -> None:
    s.num_computed_tokens = s.num_tokens
    s.token_ids.append(7)


def test_rows_are_reused_and_copied_only_within_their_salt():
    kv = KVCacheManager(num_slots=4, num_tokens_total=4000, enable_prefix_caching=True)
    a = seq("a1", [*SYSTEM, 1], "tenant-a")
    kv.allocate(a)
    computed(a)
    # While a runs, b (another salt) neither copies its row nor reuses anything.
    b = seq("b1", [*SYSTEM, 2], "tenant-b")
    assert kv.allocate(b) == ()
    assert b.num_computed_tokens == 0
    same = seq("a2", [*SYSTEM, 3], "tenant-a")
    copies = kv.allocate(same)
    assert same.num_computed_tokens == len(SYSTEM) and len(copies) == 1
    for s in (a, b, same):
        kv.free(s)
    # Freed rows keep their salt: only the same salt (not None, not another) reuses them.
    for salt, expected in ((None, 0), ("tenant-c", 0), ("tenant-a", len(SYSTEM))):
        probe = seq(f"p-{salt}", [*SYSTEM, 4], salt)
        kv.allocate(probe)
        assert probe.num_computed_tokens == expected, salt
        kv.free(probe)


def test_no_wait_for_a_running_prefix_of_another_salt():
    kv = KVCacheManager(num_slots=4, num_tokens_total=8000, enable_prefix_caching=True)
    long = list(range(2000, 2000 + MIN_WAIT_TOKENS + 50))
    first = seq("a", [*long, 1], "tenant-a")
    kv.allocate(first)  # running, nothing computed yet
    assert kv.should_wait_for_prefix(seq("a2", [*long, 2], "tenant-a"))
    assert not kv.should_wait_for_prefix(seq("b", [*long, 2], "tenant-b"))


def test_salts_combine_within_the_tenant_and_are_bounded():
    assert cache_salt_of(None, None) is None
    assert cache_salt_of(None, "mine") == "mine"
    assert cache_salt_of("team-a", None) == "team-a"
    # A client's salt splits its tenant's cache further; it can never equal another tenant's.
    assert cache_salt_of("team-a", "team-b") != cache_salt_of("team-b", None)
    with pytest.raises(ValueError, match="longer than"):
        cache_salt_of("x" * (MAX_CACHE_SALT_CHARS + 1), None)


# -- a real engine process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("salt") / "engine.log"
    proc = EngineProcess(tiny_model_dir, log, "--max-batch-size", "4").start()
    yield proc
    proc.stop()


def hits(engine: EngineProcess) -> float:
    samples = engine.metrics().items()
    return sum(value for (name, _), value in samples if name == "vllm:prefix_cache_hits_total")


def complete(engine: EngineProcess, prompt: str, salt: str | None = None, **extra) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    headers = {"Content-Type": "application/json"}
    if salt is not None:
        headers[CACHE_SALT_HEADER] = salt
    request = urllib.request.Request(
        f"{engine.url}/v1/completions", data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as error:
        return error.code


def test_engine_counts_hits_only_within_a_salt(engine):
    prompt = "The quarterly report of tenant A says revenue grew " * 12  # ~120 tokens
    assert complete(engine, prompt, "tenant-a") == 200
    before = hits(engine)
    assert complete(engine, prompt, "tenant-b") == 200  # the probe: tenant B, A's prompt
    assert hits(engine) == before
    assert complete(engine, prompt, "tenant-a", cache_salt="own") == 200  # A's sub-salt
    assert hits(engine) == before
    assert complete(engine, prompt, "tenant-a") == 200  # A's own repeat hits
    assert hits(engine) - before >= 100


def test_oversized_salts_are_400(engine):
    long = "s" * (MAX_CACHE_SALT_CHARS + 1)
    assert complete(engine, "hi", cache_salt=long) == 400
    assert complete(engine, "hi", long) == 400
    assert complete(engine, "hi", cache_salt="") == 400
    assert complete(engine, "hi", cache_salt="ok") == 200
