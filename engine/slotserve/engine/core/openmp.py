"""OpenMP thread behaviour for torch on CPU; must run before torch is imported.

Importing this module changes nothing: each entry point (the engine CLI, a benchmark, the test
suite's conftest) calls :func:`apply_openmp_environment` before anything imports torch.
"""

from __future__ import annotations

import os
import sys

# How many times an OpenMP worker polls at a barrier before it sleeps. libgomp's default spins
# for milliseconds, which collapses when other processes share the cores (a step 5-10x slower
# than one thread); sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a wake-up at each of the ~40
# ops a layer runs. Measured on 2 cores with SmolLM2 at 32 sequences: 146 ms a step passive,
# ~100 ms with a spin of 2,000-20,000 polls (tens to hundreds of microseconds).
SPIN_COUNT = "10000"


def openmp_environment() -> dict[str, str]:
    """Variables to add to ``os.environ`` before torch loads: a short spin unless one is set.

    ``OMP_WAIT_POLICY=ACTIVE`` is what makes libgomp use the spin count everywhere: otherwise,
    once more threads have run torch ops than there are cores (the thread that loaded the model
    and the engine's loop thread), it cuts spinning to ~100 polls, and steps run in the loop
    thread were ~20% slower than the same steps on the main thread.
    """
    if "torch" in sys.modules or {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
        return {}
    return {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": SPIN_COUNT}


def apply_openmp_environment() -> dict[str, str]:
    """Add :func:`openmp_environment` to ``os.environ``; returns what was added."""
    added = openmp_environment()
    os.environ.update(added)  # libgomp reads it when torch loads
    return added
