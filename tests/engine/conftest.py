"""The engine tests' entry point: the OpenMP environment before any test module imports torch.

``slotserve engine`` applies it in its CLI; in-process engines here (``LLMEngine.load`` and the
like) run with the same thread behaviour, so their timings mean what the server's do.
"""

from __future__ import annotations

from slotserve.engine.core.openmp import apply_openmp_environment

apply_openmp_environment()
