"""Fixtures shared by every suite. Part-specific fixtures live in tests/<part>/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from slotserve.settings import CommonSettings
from tests.support import RedisServer

# The engine's default prefill and decode products are bf16 on CPUs with bf16 units
# (--prefill-dtype / --decode-dtype auto), which moves logits by ~1e-2 against transformers'
# fp32: the suite's many "same tokens as HF" checks ask for fp32, here and in every engine
# process a test starts (the variables are inherited). tests/engine/test_engine_bf16_prefill.py
# and test_engine_bf16_decode.py test bf16 and auto explicitly. Likewise the KV cache, fp16 by
# default where the native kernels run (--kv-cache-dtype auto): tests/engine/
# test_engine_kv_half.py tests it.
os.environ.setdefault("SLOTSERVE_ENGINE_PREFILL_DTYPE", "float32")
os.environ.setdefault("SLOTSERVE_ENGINE_DECODE_DTYPE", "float32")
os.environ.setdefault("SLOTSERVE_ENGINE_KV_CACHE_DTYPE", "float32")


# The files holding the suite's longest tests (each over ~15 s in CI's --durations), handed
# to the workers first: with --dist loadfile a long file dealt last keeps one worker busy while
# the others idle; dealt first, the short files fill in around it. Note: xdist (3.6 on) deals
# files in this order only with --no-loadscope-reorder; by default, as `make test` runs it, it
# deals the files with the most tests first, and this order only breaks ties. One fresh-clone run
# with the flag (2026-12-07, 2-core Zen 3) was no faster: the long files' engines all started at
# once, and the drain test's deadline passed under that load.
LONG_FILES = (
    "tests/engine/test_engine_stops_server.py",
    "tests/gateway/test_gateway_admission_fuzz.py",
    "tests/operator/test_operator_admission.py",
    "tests/gateway/test_gateway_chaos.py",
    "tests/gateway/test_gateway_clients.py",
    "tests/operator/test_operator_autoscaling.py",
    "tests/engine/test_engine_openai_tools.py",
    "tests/operator/test_operator_engines.py",
    "tests/engine/test_engine_static_step_compile.py",
    "tests/gateway/test_gateway_e2e_engines.py",
    "tests/engine/test_engine_calibration.py",
    "tests/local/test_local_up.py",
    "tests/engine/test_engine_server_drain.py",
    "tests/engine/test_engine_hostile_fuzz.py",
    "tests/bench/test_bench_prefix_routing.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long files first (a stable sort: the rest keep their order). The serial tests run in two
    sessions of their own (the Makefile's ``serial-alone`` and ``serial-wall-clock``)."""
    root = config.rootpath
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))


@pytest.fixture(scope="session")
def slotserve_home() -> Path:
    """The real cache folder, so the demo model is pulled once per machine, not per run."""
    return CommonSettings().home


@pytest.fixture(scope="session")
def smollm2_dir(slotserve_home: Path) -> Path:
    """The real SmolLM2-135M-Instruct as a Hugging Face folder (pulled on first use)."""
    from slotserve.models.pull import pull_model

    return pull_model("smollm2", home=slotserve_home, show_progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A randomly initialised 2-layer Llama (hidden 64) with SmolLM2's tokenizer and template."""
    from slotserve.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir=smollm2_dir)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server on a free port, stopped after the test."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()
