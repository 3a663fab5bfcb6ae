"""The bench tests' entry point: bench/ scripts import each other as top-level modules.

The OpenMP environment is applied first, as the scripts do before they load torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from slotserve.engine.core.openmp import apply_openmp_environment

apply_openmp_environment()
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
