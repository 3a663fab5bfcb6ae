"""The bench tests' entry point: the OpenMP environment is applied first, as the scripts do before
they load torch. The scripts and their library are imported as the package ``bench`` (the
checkout's root is on the path through the editable install), never from bench/ itself.
"""

from __future__ import annotations

from slotserve.engine.core.openmp import apply_openmp_environment

apply_openmp_environment()
