"""The engine's own CPU kernels, compiled once and loaded only after checks: the matrix
products (``products.c``, ``quantized_rows.c``, ``quantize.c``, ``dispatch.c``), decode
attention (``attention.c``) and a whole Llama decode step built on them (``llama_step.c``);
their interface is ``kernels.h``.

Where the library comes from (the image's prebuilt folder, a private cache under
``SLOTSERVE_HOME``, or a fresh compile with the system's gcc) and why it is trusted before it
is loaded: :mod:`slotserve.engine.core.kernels.library`. The library links the OpenMP runtime
torch has already loaded, so its threads are torch's.

Called through ctypes with raw pointers: about a microsecond a call, against milliseconds of
weights streamed per call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path
from typing import Any

import torch

from slotserve.engine.core.kernels.library import (
    ABI,
    GROUP_SIZE,
    Build,
    KernelUnavailable,
    Loaded,
    library_name,
    load_library,
    prebuild,
)
from slotserve.engine.core.kernels.signatures import declare

__all__ = [
    "ABI",
    "GROUP_SIZE",
    "ISAS",
    "Build",
    "KernelUnavailable",
    "NativeKernels",
    "library_name",
    "load_kernels",
    "load_library",
    "pack_bf16",
    "pack_int16",
    "prebuild",
]

logger = logging.getLogger(__name__)

# The C code's instruction-set levels (ISA_C, ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16 in
# kernels.h), by name.
ISAS = ("plain_c", "avx2_fma", "avx512", "avx512_bf16")
# What int16 products run, by slotserve_kernel_int16()'s number.
INT16_PRODUCTS = ("plain_c", "avx2", "avx512_vnni")
# KV cache layers the attention kernels read in place: fp32, or fp16 widened as read (kv_half.c).
CACHE_DTYPES = (torch.float32, torch.float16)


class Scratch(ctypes.Structure):
    """``struct scratch`` of kernels.h: the workspace the C code carves its buffers from."""

    _fields_ = [
        ("base", ctypes.c_void_p),
        ("size", ctypes.c_size_t),
        ("used", ctypes.c_size_t),
        ("needed", ctypes.c_size_t),
    ]


class Workspace(threading.local):
    """The buffers of the kernels' calls on one thread (a runner steps on one thread, so this
    is the runner's): one block, grown to what the largest call so far wanted and then reused,
    so a steady-state step allocates nothing (the step's six activation buffers, the products'
    per-thread panels, the one-row int4 product's quantized row, attention's scores)."""

    def __init__(self) -> None:
        self.scratch = Scratch()
        self.pointer = ctypes.byref(self.scratch)
        self.buffer: torch.Tensor | None = None

    def begin(self) -> ctypes._CArgObject:
        self.scratch.used = self.scratch.needed = 0
        return self.pointer

    def end(self) -> None:
        """After a call: grow to what it wanted if the block was short (it used malloc)."""
        needed = self.scratch.needed
        if needed > self.scratch.size:
            size = -(-needed * 5 // 4 // 65536) * 65536  # room to spare: fewer regrowths
            self.buffer = torch.empty(size, dtype=torch.uint8)
            self.scratch.base = self.buffer.data_ptr()
            self.scratch.size = size

    @property
    def bytes(self) -> int:
        return int(self.scratch.size)


class NativeKernels:
    """The loaded library: ``y = x @ W.T`` for fp32, int8 and int4 weights (CPU tensors)."""

    def __init__(self, loaded: Loaded) -> None:
        self.build: Build = loaded.build
        lib = loaded.library
        declare(lib)
        group = lib.slotserve_kernel_group_size()
        if group != GROUP_SIZE:  # the header was read at import; this is the library loaded
            raise KernelUnavailable(f"the kernel library groups {group} weights, not {GROUP_SIZE}")
        self._lib = lib
        self.workspace = Workspace()

    def fallback_allocations(self) -> int:
        """Buffers the C code took from malloc because a workspace was short (process-wide)."""
        return int(self._lib.slotserve_kernel_fallback_allocations())

    @property
    def isa(self) -> str:
        """The instruction set the kernels run: ``avx512_bf16`` (bf16 weights multiplied by
        VDPBF16PS, and what ``avx512`` runs), ``avx512`` (the fp32 panel products 512 bits wide,
        the rest AVX2/FMA), ``avx2_fma`` or ``plain_c``."""
        return ISAS[self._lib.slotserve_kernel_isa()]

    @property
    def supported_isas(self) -> list[str]:
        """Every instruction set this CPU can run the kernels with, narrowest first."""
        return list(ISAS[: self._lib.slotserve_kernel_supported_isa() + 1])

    @property
    def amx(self) -> bool:
        """Whether the AMX tiles run bf16 products of 16 rows or more (``gemm_amx.c``) and bf16
        prefill attention (``attention_amx.c``): the CPU has AMX-BF16, the OS granted the tiles,
        ``avx512_bf16`` is in use and they are not turned off."""
        return bool(self._lib.slotserve_kernel_amx())

    @property
    def int16_products(self) -> str:
        """What int16 products (:meth:`gemm_int16`) run: ``avx512_vnni`` (VPDPWSSD: the CPU has
        AVX512_VNNI and ``avx512`` or wider is in use), ``avx2`` (VPMADDWD) or ``plain_c``; all
        three give the same results to the bit."""
        return INT16_PRODUCTS[self._lib.slotserve_kernel_int16()]

    def set_amx(self, enabled: bool) -> bool:
        """Turn the AMX tiles on (where they can run) or off (tests, benchmarks); returns
        :attr:`amx`."""
        return bool(self._lib.slotserve_kernel_set_amx(int(enabled)))

    def set_fused_layers(self, enabled: bool) -> bool:
        """Fuse the native step's layers where its products are bf16 (the default), or run
        them product by product (tests compare the two); returns the setting."""
        return bool(self._lib.slotserve_kernel_set_fused_layers(int(enabled)))

    def fused_layers_run(self) -> int:
        """Layers the native step has run fused so far (process-wide)."""
        return int(self._lib.slotserve_kernel_fused_layers_run())

    def set_isa(self, isa: str) -> str:
        """Run ``isa``, or the widest this CPU has below it (tests, benchmarks); returns it."""
        return ISAS[self._lib.slotserve_kernel_set_isa(ISAS.index(isa))]

    @property
    def avx2(self) -> bool:
        """Whether the kernels run SIMD code (AVX2/FMA or wider), else the plain C one."""
        return self.isa != "plain_c"

    def set_avx2(self, enabled: bool) -> bool:
        """The widest code this CPU has if ``enabled``, else plain C; returns :attr:`avx2`."""
        self.set_isa(ISAS[-1] if enabled else "plain_c")
        return self.avx2

    def set_prefetch(self, distance: int | None) -> None:
        """Prefetch weights ``distance`` bytes ahead of the products (0: off; None: the
        default), for benchmarks and tests."""
        self._lib.slotserve_kernel_set_prefetch(-1 if distance is None else distance)

    def gemm_f32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        m, k, out = self._begin(x, weight.shape[0])
        self._run(
            self._lib.slotserve_gemm_f32,
            x.data_ptr(),
            m,
            k,
            weight.data_ptr(),
            weight.shape[0],
            out.data_ptr(),
            _threads(),
        )
        return out

    def gemm_int16(
        self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int
    ) -> torch.Tensor:
        """``x @ W.T`` for the ``n`` channels of ``packed`` and ``scale`` (:func:`pack_int16`'s
        layout): x's rows scaled to int16 per group of 64 columns, exact int32 sums per group,
        then fp32 (``kernels/int16.c``; :attr:`int16_products` says which code runs)."""
        m, k, out = self._begin(x, n)
        blocks = -(-n // 16)
        if (
            packed.dtype != torch.int16
            or not packed.is_contiguous()
            or tuple(packed.shape) != (blocks, k // 2, 16, 2)
            or k % 2
            or scale.dtype != torch.float32
            or not scale.is_contiguous()
            or scale.numel() != blocks * 16
        ):
            raise ValueError(
                f"gemm_int16 takes packed int16 weights [{blocks}, {k // 2}, 16, 2] and "
                f"{blocks * 16} fp32 scales for {n} channels of {k} (pack_int16), got "
                f"{packed.dtype} {tuple(packed.shape)} and {scale.dtype} {tuple(scale.shape)}"
            )
        self._run(
            self._lib.slotserve_gemm_int16,
            x.data_ptr(),
            m,
            k,
            packed.data_ptr(),
            scale.data_ptr(),
            n,
            out.data_ptr(),
            _threads(),
        )
        return out

    def gemm_bf16(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """``x @ W.T`` for the ``n`` channels of ``packed`` (:func:`pack_bf16`'s layout): x
        rounded to bf16, products accumulated in fp32."""
        m, k, out = self._begin(x, n)
        blocks = -(-n // 16)
        if (
            packed.dtype != torch.bfloat16
            or not packed.is_contiguous()
            or tuple(packed.shape) != (blocks, k // 2, 16, 2)
            or k % 2
        ):
            raise ValueError(
                f"gemm_bf16 takes packed bf16 weights [{blocks}, {k // 2}, 16, 2] for {n} "
                f"channels of {k} (pack_bf16), got {packed.dtype} {tuple(packed.shape)}"
            )
        self._run(
            self._lib.slotserve_gemm_bf16,
            x.data_ptr(),
            m,
            k,
            packed.data_ptr(),
            n,
            out.data_ptr(),
            _threads(),
        )
        return out

    def mlp_bf16(
        self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, inter: int
    ) -> torch.Tensor:
        """A decoder MLP, ``down(silu(x @ gate.T) * (x @ up.T))``, on packed bf16 weights
        (:func:`pack_bf16` of the gate's and up's rows stacked, and of down's): one fused pass
        on the AMX tiles where they run, or on VDPBF16PS where the kernels run AVX512_BF16
        (silu(gate) * up rounded to bf16 in the registers), else the two products with SiLU
        between."""
        m, hidden, out = self._begin(x, x.shape[1] if x.dim() == 2 else 0)
        if (
            inter % 16
            or hidden % 16
            or tuple(gate_up.shape) != (2 * inter // 16, hidden // 2, 16, 2)
            or tuple(down.shape) != (hidden // 16, inter // 2, 16, 2)
            or any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in (gate_up, down))
        ):
            raise ValueError(
                f"mlp_bf16 takes packed bf16 gate/up [{2 * inter // 16}, {hidden // 2}, 16, 2] "
                f"and down [{hidden // 16}, {inter // 2}, 16, 2] (hidden and inter multiples of "
                f"16), got {gate_up.dtype} {tuple(gate_up.shape)} and {down.dtype} "
                f"{tuple(down.shape)}"
            )
        self._run(
            self._lib.slotserve_mlp_bf16,
            x.data_ptr(),
            m,
            hidden,
            gate_up.data_ptr(),
            down.data_ptr(),
            inter,
            out.data_ptr(),
            _threads(),
        )
        return out

    def gemm_q8(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        m, k, out = self._begin(x, q.shape[0])
        self._run(
            self._lib.slotserve_gemm_q8,
            x.data_ptr(),
            m,
            k,
            q.data_ptr(),
            scale.data_ptr(),
            q.shape[0],
            out.data_ptr(),
            _threads(),
        )
        return out

    def gemm_q4(
        self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
    ) -> torch.Tensor:
        m, k, out = self._begin(x, q.shape[0])
        self._run(
            self._lib.slotserve_gemm_q4,
            x.data_ptr(),
            m,
            k,
            q.data_ptr(),
            scale.data_ptr(),
            minimum.data_ptr(),
            q.shape[0],
            out.data_ptr(),
            _threads(),
        )
        return out

    def gemm_quantized_bf16(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ W.T`` for int8 (``minimum`` None) or int4 weights (:meth:`quantize_q8`,
        :meth:`quantize_q4`) with the rows of x and the dequantized weights rounded to bf16 and
        the products accumulated in fp32: what a quantized model's wide steps take where the
        kernels run AVX512_BF16 (VDPBF16PS; the plain C reference elsewhere)."""
        m, k, out = self._begin(x, q.shape[0])
        kind, dtype, width = (1, torch.int8, k) if minimum is None else (2, torch.uint8, k // 2)
        groups = (q.shape[0], k // GROUP_SIZE)
        if (
            k % GROUP_SIZE
            or q.dtype != dtype
            or tuple(q.shape) != (q.shape[0], width)
            or tuple(scale.shape) != groups
            or (minimum is not None and tuple(minimum.shape) != groups)
            or not all(
                t.is_contiguous() for t in (q, scale) + (() if minimum is None else (minimum,))
            )
        ):
            raise ValueError(
                f"gemm_quantized_bf16 takes quantize_q8's or quantize_q4's tensors for rows of "
                f"{k} (a multiple of {GROUP_SIZE}), got {q.dtype} {tuple(q.shape)}"
            )
        self._run(
            self._lib.slotserve_gemm_quantized_bf16,
            kind,
            x.data_ptr(),
            m,
            k,
            q.data_ptr(),
            scale.data_ptr(),
            None if minimum is None else minimum.data_ptr(),
            q.shape[0],
            out.data_ptr(),
            _threads(),
        )
        return out

    def quantize_q8(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric int8 in groups of 32 along K: ``(q [N, K] int8, scale [N, K/32])``."""
        w, n, k = _weight(weight)
        q = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(n, k // GROUP_SIZE, dtype=torch.float32)
        self._lib.slotserve_quantize_q8(
            w.data_ptr(), n, k, q.data_ptr(), scale.data_ptr(), _threads()
        )
        return q, scale

    def quantize_q4(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int4 groups of 32 along K with scale and minimum: ``(q [N, K/2] uint8, scale
        [N, K/32], minimum [N, K/32])``; byte j of a group holds weights j and j + 16."""
        w, n, k = _weight(weight)
        q = torch.empty(n, k // 2, dtype=torch.uint8)
        scale = torch.empty(n, k // GROUP_SIZE, dtype=torch.float32)
        minimum = torch.empty_like(scale)
        self._lib.slotserve_quantize_q4(
            w.data_ptr(), n, k, q.data_ptr(), scale.data_ptr(), minimum.data_ptr(), _threads()
        )
        return q, scale, minimum

    def dequantize_q8(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The fp32 weight ``q * scale`` ([N, K])."""
        return self._dequantize(1, q, scale, None, q.shape[1])

    def dequantize_q4(
        self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
    ) -> torch.Tensor:
        """The fp32 weight of packed int4 groups ([N, K] from [N, K/2] bytes)."""
        return self._dequantize(2, q, scale, minimum, q.shape[1] * 2)

    def _dequantize(
        self, kind: int, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, k: int
    ) -> torch.Tensor:
        out = torch.empty(q.shape[0], k, dtype=torch.float32)
        self._lib.slotserve_dequantize(
            kind,
            q.data_ptr(),
            scale.data_ptr(),
            None if minimum is None else minimum.data_ptr(),
            q.shape[0],
            k,
            out.data_ptr(),
            _threads(),
        )
        return out

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Softmax attention of one query per row over its slot's first ``lens[row]`` cache
        positions, read in place. ``q``: [rows, kv_heads, group, D]; caches: [slots, kv_heads,
        max_len, D] with slots >= rows, both float32 or both float16 (widened as read);
        ``lens``: int64 [rows] (0: the row's output is zeros; at most max_len positions are
        read)."""
        rows, kv_heads, group, d = q.shape
        slots, cache_heads, max_len, cache_d = k_cache.shape
        if (
            q.dtype != torch.float32
            or k_cache.dtype not in CACHE_DTYPES
            or v_cache.shape != k_cache.shape
            or v_cache.dtype != k_cache.dtype
            or not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
            or (cache_heads, cache_d) != (kv_heads, d)
            or slots < rows
            or lens.dtype != torch.int64
            or lens.shape != (rows,)
        ):
            raise ValueError("decode_attention: tensors of the wrong shape, layout or dtype")
        out = torch.empty_like(q)
        self._run(
            self._lib.slotserve_decode_attention,
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.float16),
            rows,
            kv_heads,
            group,
            d,
            max_len,
            lens.data_ptr(),
            scale,
            out.data_ptr(),
            _threads(),
        )
        return out

    def slot_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        *,
        bf16: bool = False,
    ) -> torch.Tensor:
        """:meth:`decode_attention` with row r reading cache row ``slots[r]`` (int64 [rows]):
        what the native step runs, where the rows of a prefill chunk share one slot and row r
        attends to positions [0, lens[r]) (its own included: causal within the chunk).
        ``bf16``: a chunk's blocks of rows in bf16 where the CPU has AVX512_BF16, as a bf16
        step runs them."""
        rows, kv_heads, group, d = q.shape
        if (
            slots.dtype != torch.int64
            or slots.shape != (rows,)
            or not slots.is_contiguous()
            or (rows and not 0 <= int(slots.min()) <= int(slots.max()) < k_cache.shape[0])
        ):
            raise ValueError("slot_attention: slots must be int64 [rows] inside the cache")
        # The other checks are decode_attention's (a cache of at least one slot per row aside).
        if (
            q.dtype != torch.float32
            or k_cache.dtype not in CACHE_DTYPES
            or v_cache.shape != k_cache.shape
            or v_cache.dtype != k_cache.dtype
            or not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
            or tuple(k_cache.shape[1::2]) != (kv_heads, d)
            or lens.dtype != torch.int64
            or lens.shape != (rows,)
        ):
            raise ValueError("slot_attention: tensors of the wrong shape, layout or dtype")
        out = torch.empty_like(q)
        self._run(
            self._lib.slotserve_attend_bf16 if bf16 else self._lib.slotserve_attend,
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.float16),
            rows,
            slots.data_ptr(),
            kv_heads,
            group,
            d,
            k_cache.shape[2],
            lens.data_ptr(),
            scale,
            out.data_ptr(),
            _threads(),
        )
        return out

    def llama_step(
        self,
        model: ctypes.Structure,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """One decode step of every layer of ``model`` (a ``StepModel`` from
        :mod:`slotserve.engine.core.model.native_decode`, which checks the shapes) on ``hidden``
        [rows, hidden] in place: embeddings in, final-normed hidden states out."""
        self._run(
            self._lib.slotserve_llama_step,
            ctypes.byref(model),
            hidden.shape[0],
            hidden.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            positions.data_ptr(),
            _threads(),
        )

    def _run(self, function: Any, *args: object) -> None:
        """Call ``function(*args, workspace)``: the C code's buffers come from this thread's
        workspace, grown after a call that found it short."""
        workspace = self.workspace
        status = function(*args, workspace.begin())
        workspace.end()
        _check(status)

    @staticmethod
    def _begin(x: torch.Tensor, n: int) -> tuple[int, int, torch.Tensor]:
        # Callers pass contiguous fp32 CPU rows; a wrong tensor here would read stray memory.
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.is_cuda:
            raise ValueError("native kernels take contiguous 2-D float32 CPU rows")
        m, k = x.shape
        return m, k, torch.empty(m, n, dtype=torch.float32)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (K even) as :meth:`NativeKernels.gemm_bf16` reads it: rounded to bf16,
    channels in blocks of 16 (the last padded with zeros), each block's 16 weights of a column
    pair side by side, i.e. [ceil(N/16), K/2, 16, 2] (kernels.h)."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"packed bf16 weights need an even K, got {k}")
    blocks = -(-n // 16)
    w = weight.detach().to(torch.bfloat16)
    if blocks * 16 != n:
        w = torch.cat([w, w.new_zeros(blocks * 16 - n, k)])
    return w.view(blocks, 16, k // 2, 2).transpose(1, 2).contiguous()


# The packed int16 weights' bound (int16.c): 64 products of it and the rows' 4095 fit int32.
INT16_WEIGHT_MAX = 8191


def pack_int16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (K even) as :meth:`NativeKernels.gemm_int16` reads it: each channel
    scaled to integers within +-8191 (nearest even; its scale its largest magnitude / 8191),
    laid out as :func:`pack_bf16`'s blocks; returns the integers [ceil(N/16), K/2, 16, 2] and
    the scales [ceil(N/16) * 16] (zeros past N)."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"packed int16 weights need an even K, got {k}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("packed int16 weights need finite weights")
    blocks = -(-n // 16)
    scale = w.abs().amax(1) / INT16_WEIGHT_MAX
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(w * inverse[:, None]).clamp_(-INT16_WEIGHT_MAX, INT16_WEIGHT_MAX)
    q = q.to(torch.int16)
    if blocks * 16 != n:
        q = torch.cat([q, q.new_zeros(blocks * 16 - n, k)])
        scale = torch.cat([scale, scale.new_zeros(blocks * 16 - n)])
    return q.view(blocks, 16, k // 2, 2).transpose(1, 2).contiguous(), scale.contiguous()


def _weight(weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    w = weight.detach().float().contiguous()
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"quantized weights need K a multiple of {GROUP_SIZE}, got {k}")
    return w, n, k


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("the native kernels could not allocate their buffers")


def _threads() -> int:
    return torch.get_num_threads()


@functools.cache
def load_kernels(home: Path) -> NativeKernels:
    """Build (or find) and load the library; raises :class:`KernelUnavailable`."""
    kernels = NativeKernels(load_library(home))
    built = kernels.build
    logger.info(
        "native kernels %s (%s, %.2f s), %s",
        built.path,
        built.origin,
        built.seconds,
        {
            "avx512_bf16": "AVX512_BF16 bf16 products, AVX-512 fp32 panels, AVX2/FMA elsewhere",
            "avx512": "AVX-512 fp32 panels, AVX2/FMA elsewhere"
            + (", AVX512_VNNI int16 products" if kernels.int16_products == "avx512_vnni" else ""),
            "avx2_fma": "AVX2/FMA",
            "plain_c": "plain C (no AVX2/FMA on this CPU)",
        }[kernels.isa]
        + (
            ", AMX-BF16 tiles (bf16 products of 16 rows or more, prefill attention)"
            if kernels.amx
            else ""
        ),
    )
    return kernels
