"""Runtime instruction-set dispatch (issue 24, item 2): the kernels run the widest code the CPU
has (cpuid), every variant this machine supports gives the plain C reference's answers, and
which one runs is reported (the start-up log and ``/load``'s ``native_kernels`` record)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slotserve.engine.core.kernels import ISAS, NativeKernels, load_kernels
from slotserve.settings import CommonSettings
from tests.engine.engine_core_support import runner_on


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    return load_kernels(CommonSettings().home)


# avx512_bf16 runs the avx512 code for these kernels (test_engine_bf16_*.py test its own).
@pytest.fixture(params=[isa for isa in ISAS if isa not in ("plain_c", "avx512_bf16")])
def simd(request, kernels: NativeKernels) -> Iterator[str]:
    if request.param not in kernels.supported_isas:
        pytest.skip(f"this CPU cannot run {request.param}")
    yield request.param
    kernels.set_isa(ISAS[-1])


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def test_the_widest_instruction_set_the_cpu_has_runs(kernels):
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    expected = "plain_c"
    if {"avx2", "fma"} <= flags:
        expected = "avx2_fma"
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            expected = "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    assert kernels.supported_isas[-1] == expected
    assert kernels.isa == expected
    assert kernels.supported_isas == list(ISAS[: ISAS.index(expected) + 1])


def test_an_instruction_set_the_cpu_lacks_is_never_granted(kernels):
    try:
        for isa in ISAS:
            granted = kernels.set_isa(isa)
            assert granted in kernels.supported_isas
            assert ISAS.index(granted) <= ISAS.index(isa)
    finally:
        kernels.set_isa(ISAS[-1])


def outputs(kernels: NativeKernels, isa: str, call) -> torch.Tensor:
    kernels.set_isa(isa)
    try:
        return call()
    finally:
        kernels.set_isa(ISAS[-1])


# K: 16-multiples take the 512-bit panels, 200 (8-multiple) the AVX2 ones in the same call;
# rows: the 4-row blocks and 3/2/1 leftovers of the 512-bit code, one row (memory-bound), and
# the wide products from 64 rows (AVX2: packed blocks of 16 channels, tiles of 6 rows, N 12 and
# 8 one partial block; AVX-512: row blocks of 12, 77 leaves 5).
@pytest.mark.parametrize("n,k", [(64, 64), (132, 160), (12, 200), (8, 576)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 33, 64, 77])
def test_every_variant_gives_the_plain_c_answers(kernels, simd, n, k, m):
    generator = torch.Generator().manual_seed(n + 7 * k + 131 * m)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(m, k, generator=generator)
    calls = [lambda: kernels.gemm_f32(x, weight)]
    if k % 32 == 0:
        q8, s8 = kernels.quantize_q8(weight)
        calls.append(lambda: kernels.gemm_q8(x, q8, s8))
        if m > 1:  # one row holds x as int16 by design: test_engine_kernels bounds that error
            q4, s4, m4 = kernels.quantize_q4(weight)
            calls.append(lambda: kernels.gemm_q4(x, q4, s4, m4))
    for call in calls:
        reference = outputs(kernels, "plain_c", call)
        torch.testing.assert_close(outputs(kernels, simd, call), reference, rtol=1e-4, atol=1e-4)


def test_every_variant_steps_as_plain_c_does(kernels, simd):
    """A whole native decode step (every kernel at once) under each variant."""
    from tests.engine.test_engine_calibration import tiny_llama

    runner = runner_on(tiny_llama(), num_slots=4, max_model_len=64, linear_backend="native")
    step = runner.native_step
    assert step is not None
    hidden = {}
    for isa in ("plain_c", simd):
        kernels.set_isa(isa)
        try:
            # The same positions each time: the step rewrites the cache rows it attends to.
            step([3, 1, 4, 1], [0, 0, 0, 0], [0, 1, 2, 3])
            hidden[isa] = step([5, 9, 2, 6], [1, 1, 1, 1], [0, 1, 2, 3])
        finally:
            kernels.set_isa(ISAS[-1])
    torch.testing.assert_close(hidden[simd], hidden["plain_c"], rtol=1e-4, atol=1e-4)


def test_the_start_up_log_and_load_report_say_which_ran(tmp_path, caplog):
    from slotserve.engine.core.model.calibration import CalibrationCache
    from tests.engine.test_engine_calibration import tiny_llama

    caplog.set_level(logging.INFO)
    kernels = load_kernels(tmp_path / "home")  # a fresh build: its load is logged
    assert any(
        "native kernels" in r.getMessage() and kernels.build.origin in r.getMessage()
        for r in caplog.records
    )
    runner = runner_on(
        tiny_llama(), num_slots=4, max_model_len=64, calibration=CalibrationCache(tmp_path)
    )
    record = runner.calibrations[-1]
    assert (record.name, record.choice) == (
        "native_kernels",
        load_kernels(CommonSettings().home).isa,
    )
