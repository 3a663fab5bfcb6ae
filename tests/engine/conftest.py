"""The engine tests' entry point: the OpenMP environment before any test module imports torch.

``slotserve engine`` applies it in its CLI; in-process engines here (``LLMEngine.load`` and the
like) run with the same thread behaviour, so their timings mean what the server's do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slotserve.engine.core.openmp import apply_openmp_environment

if TYPE_CHECKING:
    from tests.engine.engine_server_support import EngineProcess

apply_openmp_environment()


@pytest.fixture(scope="session")
def smollm2_engine(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """One real SmolLM2 ``slotserve engine`` process for every test that only sends it requests.

    Started once (~10 s, more on a busy machine) instead of once per test. max_model_len 8192
    (SmolLM2's own) is what the hostile-prompt tests need: prompts up to 8192 x 81 = 663,552
    characters pass the cheap bound, so the largest ones really are tokenized (~0.5 s of
    tokenizer time each); the other tests' short answers fit in any length.
    """
    from tests.engine.engine_server_support import EngineProcess

    engine = EngineProcess(
        smollm2_dir,
        tmp_path_factory.mktemp("smollm2-engine") / "engine.log",
        "--max-model-len", "8192", "--max-batch-size", "2", "--kv-cache-tokens", "4096",
        name="smollm2",
    )  # fmt: skip
    engine.start(timeout=180)
    yield engine
    engine.stop()
