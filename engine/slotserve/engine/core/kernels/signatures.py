"""The ctypes side of ``kernels.h``: each exported function's result and argument types.

Pointers of every kind are ``c_void_p`` (callers pass ``data_ptr()`` integers, ``byref`` or
None); ``tests/engine/test_engine_kernel_header.py`` checks this table against the header's
prototypes and the built library's exported symbols, so neither side can drift alone.
"""

from __future__ import annotations

import ctypes
from typing import Any

PTR, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SCRATCH = PTR  # struct scratch *: every call's last argument but the library's own settings

# name -> (result type or None for void, argument types)
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "slotserve_kernel_abi": (INT, []),
    "slotserve_kernel_group_size": (INT, []),
    "slotserve_kernel_isa": (INT, []),
    "slotserve_kernel_supported_isa": (INT, []),
    "slotserve_kernel_set_isa": (INT, [INT]),
    "slotserve_kernel_amx": (INT, []),
    "slotserve_kernel_set_amx": (INT, [INT]),
    "slotserve_kernel_int16": (INT, []),
    "slotserve_kernel_set_fused_layers": (INT, [INT]),
    "slotserve_kernel_fused_layers_run": (ctypes.c_uint64, []),
    "slotserve_kernel_fallback_allocations": (ctypes.c_uint64, []),
    "slotserve_kernel_set_prefetch": (None, [I64]),
    "slotserve_quantize_q8": (None, [PTR, I64, I64, PTR, PTR, INT]),
    "slotserve_quantize_q4": (None, [PTR, I64, I64, PTR, PTR, PTR, INT]),
    "slotserve_dequantize": (None, [INT, PTR, PTR, PTR, I64, I64, PTR, INT]),
    "slotserve_gemm_f32": (INT, [PTR, I64, I64, PTR, I64, PTR, INT, SCRATCH]),
    "slotserve_gemm_q8": (INT, [PTR, I64, I64, PTR, PTR, I64, PTR, INT, SCRATCH]),
    "slotserve_gemm_q4": (INT, [PTR, I64, I64, PTR, PTR, PTR, I64, PTR, INT, SCRATCH]),
    "slotserve_gemm_bf16": (INT, [PTR, I64, I64, PTR, I64, PTR, INT, SCRATCH]),
    "slotserve_gemm_quantized_bf16": (
        INT,
        [INT, PTR, I64, I64, PTR, PTR, PTR, I64, PTR, INT, SCRATCH],
    ),
    "slotserve_gemm_int16": (INT, [PTR, I64, I64, PTR, PTR, I64, PTR, INT, SCRATCH]),
    "slotserve_mlp_bf16": (INT, [PTR, I64, I64, PTR, PTR, I64, PTR, INT, SCRATCH]),
    "slotserve_attend": (
        INT,
        [PTR, PTR, PTR, INT, I64, PTR, I64, I64, I64, I64, PTR, F32, PTR, INT, SCRATCH],
    ),
    "slotserve_attend_bf16": (
        INT,
        [PTR, PTR, PTR, INT, I64, PTR, I64, I64, I64, I64, PTR, F32, PTR, INT, SCRATCH],
    ),
    "slotserve_decode_attention": (
        INT,
        [PTR, PTR, PTR, INT, I64, I64, I64, I64, I64, PTR, F32, PTR, INT, SCRATCH],
    ),
    "slotserve_llama_step": (INT, [PTR, I64, PTR, PTR, PTR, PTR, PTR, INT, SCRATCH]),
}


def declare(lib: ctypes.CDLL) -> None:
    """Set every exported function's ``restype`` and ``argtypes`` on ``lib``."""
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = list(argtypes)
