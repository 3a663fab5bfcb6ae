"""Gateway fixtures (helpers live in gateway_support.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_support import Spawner


@pytest.fixture
def spawn(tmp_path: Path):
    spawner = Spawner(tmp_path)
    try:
        yield spawner
    finally:
        spawner.stop_all()
