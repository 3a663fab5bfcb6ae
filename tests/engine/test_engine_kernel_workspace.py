"""The kernels' per-runner workspace (issue 24, item 4): once it has grown to a shape, a native
decode step and the one-row products allocate nothing. The C code counts every buffer it had to
take from malloc (a missing or short workspace); steady-state calls must add none, and the
malloc path still gives the same answers."""

from __future__ import annotations

import threading

import pytest
import torch

from slotserve.engine.core.kernels import NativeKernels, load_kernels
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import runner_on


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


def allocations_of(kernels: NativeKernels, call) -> int:
    before = kernels.fallback_allocations()
    call()
    return kernels.fallback_allocations() - before


@pytest.mark.parametrize("fmt", ["int4", "int8", "float32"])
@pytest.mark.parametrize("m", [1, 4])
def test_products_allocate_nothing_once_the_workspace_has_grown(kernels, fmt, m):
    torch.manual_seed(m)
    weight = torch.randn(96, 192)
    x = torch.randn(m, 192)
    if fmt == "int4":
        q, scale, minimum = kernels.quantize_q4(weight)

        def call() -> torch.Tensor:
            return kernels.gemm_q4(x, q, scale, minimum)
    elif fmt == "int8":
        q8, scale8 = kernels.quantize_q8(weight)

        def call() -> torch.Tensor:
            return kernels.gemm_q8(x, q8, scale8)
    else:

        def call() -> torch.Tensor:
            return kernels.gemm_f32(x, weight)

    first = call()
    assert allocations_of(kernels, lambda: [call() for _ in range(20)]) == 0
    torch.testing.assert_close(call(), first)


def test_a_short_workspace_falls_back_to_malloc_and_grows(kernels):
    """A fresh thread has an empty workspace: its first call takes malloc'd buffers (same
    answer), grows the workspace, and the calls after it allocate nothing."""
    weight = torch.randn(64, 4096)
    q, scale, minimum = kernels.quantize_q4(weight)
    x = torch.randn(1, 4096)
    expected = kernels.gemm_q4(x, q, scale, minimum)
    seen: dict[str, object] = {}

    def fresh_thread() -> None:
        seen["first"] = allocations_of(
            kernels, lambda: seen.update(out=kernels.gemm_q4(x, q, scale, minimum))
        )
        seen["size"] = kernels.workspace.bytes
        seen["later"] = allocations_of(kernels, lambda: kernels.gemm_q4(x, q, scale, minimum))

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join(60)
    assert seen["first"] == 1 and seen["later"] == 0
    size = seen["size"]
    assert isinstance(size, int) and size >= 4096 * 2  # the int16 row at least
    torch.testing.assert_close(seen["out"], expected)


def test_decode_attention_allocates_nothing_in_steady_state(kernels):
    rows, kv_heads, group, d, max_len = 3, 2, 3, 64, 256
    q = torch.randn(rows, kv_heads, group, d)
    k = torch.randn(rows, kv_heads, max_len, d)
    v = torch.randn(rows, kv_heads, max_len, d)
    lens = torch.tensor([256, 17, 100])
    kernels.decode_attention(q, k, v, lens, 0.125)
    assert (
        allocations_of(
            kernels, lambda: [kernels.decode_attention(q, k, v, lens, 0.125) for _ in range(10)]
        )
        == 0
    )


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_native_decode_step_allocates_nothing_in_steady_state(kernels, quantization):
    from tests.engine.test_engine_calibration import tiny_llama

    runner = runner_on(
        tiny_llama(),
        num_slots=4,
        max_model_len=64,
        linear_backend="native",
        quantization=quantization,
    )
    step = runner.native_step
    assert step is not None
    step([1, 2, 3, 4], [0, 0, 0, 0], [0, 1, 2, 3])  # the widest step: the workspace grows

    def steps() -> None:
        for position in range(1, 12):
            rows = 1 + position % 4
            step(list(range(5, 5 + rows)), [position] * rows, list(range(rows)))

    assert allocations_of(kernels, steps) == 0
