"""How an engine holds a model's weights: ``dtype`` and ``quantization``, declared once.

Each is a value type (the ``Literal``) and a field type (``Annotated`` with its description):
the operator's ``ModelSpec`` (so the CRD's schema), the engine's ``EngineSettings`` (so its
``--help``) and the engine command line (``engine_argv``) all use these, so every part accepts
the same values and tells a user the same thing about them.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[DType, ...] = get_args(DType)
Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS: tuple[Quantization, ...] = get_args(Quantization)

WeightDType = Annotated[
    DType,
    Field(
        description="Weight dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16 or "
        "float16; quantization needs float32 weights (auto on CPU)."
    ),
]
# What the kernels do (engine/.../model/quantize.py, kernels/qgemm.c): both formats work in groups
# of 32 weights along a layer's input, not one scale per output channel.
WeightQuantization = Annotated[
    Quantization,
    Field(
        description="Weight-only quantization of the linear layers, CPU only: none, int8 (one "
        "scale per group of 32 weights, llama.cpp's Q8_0) or int4 (a scale and a minimum per "
        "group of 32 weights, Q4_1; the output projection stays int8)."
    ),
]
