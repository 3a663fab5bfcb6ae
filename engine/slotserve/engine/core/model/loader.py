"""Start-up: the one place that resolves what a load needs and assembles the torch half.

It reads the common settings once (``SLOTSERVE_HOME``: the model store, the kernels' cache,
the calibration cache), picks device, dtype and decode step, looks the native kernels up once,
loads the model, sizes the KV cache, prepares the model's layers
(:func:`~slotserve.engine.core.model.prepare.prepare_model`) and builds the runner.
``LLMEngine.load`` calls :func:`load_engine_parts`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.core.generation_defaults import GenerationDefaults, load_generation_defaults
from slotserve.engine.core.kernels import KernelUnavailable, NativeKernels, load_kernels
from slotserve.engine.core.memory import (
    SYSTEM,
    MemorySources,
    size_kv_cache,
    spare_rows_problem,
)
from slotserve.engine.core.memory import available_memory_bytes as host_available_memory_bytes
from slotserve.engine.core.model.calibration import CalibrationCache
from slotserve.engine.core.model.kv_dtype import pick_kv_dtype
from slotserve.engine.core.model.prepare import is_static, prepare_model
from slotserve.engine.core.model.quantize import check_device
from slotserve.engine.core.model.runner import ModelRunner, ModelShape, check_window
from slotserve.engine.core.model.static_memory import (
    fuse_before_sizing,
    headroom_bytes,
    kv_budget_bytes,
)
from slotserve.engine.core.protocols import Tokenizer
from slotserve.engine.settings import DecodeStep, EngineSettings, OverlapSteps
from slotserve.models.resolve import default_served_name, resolve_model
from slotserve.settings import CommonSettings

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # CPUs without bf16 units run fp32 fastest; GPUs run bf16.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[dtype]


def pick_decode_step(decode_step: DecodeStep, device: torch.device) -> DecodeStep:
    """``auto``: the compiled static step on CUDA (graphs), the classic path elsewhere (the
    native C step is the fast one on a CPU)."""
    if decode_step == "auto":
        return "compiled" if device.type == "cuda" else "classic"
    return decode_step


def pick_overlap_steps(
    overlap: OverlapSteps, decode_step: DecodeStep, device: torch.device
) -> bool:
    """``auto``: on with the compiled step on CUDA, where the step is launched asynchronously
    and the host's postprocessing hides behind the device's work; off elsewhere (on a CPU the
    step runs on the calling thread, so there is nothing to hide behind: bench/overlap_bench.py
    measures it). ``on`` needs the static step (static or compiled)."""
    static = is_static(decode_step)
    if overlap == "on" and not static:
        raise UnsupportedSettingError(
            f"overlap_steps on overlaps the static decode step: it needs decode_step static or "
            f"compiled (got {decode_step})"
        )
    if overlap == "auto":
        return decode_step == "compiled" and device.type == "cuda"
    return overlap == "on"


def find_kernels(
    device: torch.device, dtype: torch.dtype, home: Path, *, quantization: str = "none"
) -> NativeKernels | None:
    """The native kernels for this device and dtype, looked up (built, or found in the image or
    under ``home``) once per load; None where they do not serve it or cannot be built (the
    torch code paths run instead: slower, never wrong). A quantization is refused here, before
    the model loads, where it cannot run, and needs them (a missing compiler raises)."""
    if quantization != "none":
        check_device(quantization, device, dtype)
        kernels = load_kernels(home)
        if not kernels.avx2:
            logger.warning(
                "quantization %s: this CPU lacks AVX2/FMA; the kernels run their plain C "
                "version (correct, several times slower)",
                quantization,
            )
        return kernels
    if device.type != "cpu" or dtype != torch.float32:
        return None
    try:
        return load_kernels(home)
    except KernelUnavailable as error:
        logger.warning("native kernels unavailable, decode attention runs in torch: %s", error)
        return None


def load_model(source: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Tokenizer]:
    """Load model and tokenizer from a local folder or hub id (already resolved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    # transformers' stubs type the wrapped `to` as taking the model itself, not a device.
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    # transformers types decode() and apply_chat_template() for every input shape and flag
    # (-> str | list[str]; messages as dict[str, str]); for the flat id lists, tokenize=False and
    # messages (with tool calls) the engine passes, they are what Tokenizer declares.
    return model, tokenizer  # type: ignore[return-value]


def available_memory_bytes(device: torch.device, sources: MemorySources) -> int:
    """Free memory on the device (GPU), or RAM this process may still use (CPU: the node's,
    capped by the container's cgroup limit)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_memory_bytes(sources)


@dataclass(frozen=True)
class EngineParts:
    """What :class:`~slotserve.engine.core.engine.LLMEngine` is built from."""

    runner: ModelRunner
    tokenizer: Tokenizer
    kv_cache_tokens: int
    model_name: str
    generation_defaults: GenerationDefaults


def load_engine_parts(settings: EngineSettings) -> EngineParts:
    """Resolve the model named in ``settings``, load it and size the KV cache (blocking,
    seconds)."""
    home = CommonSettings().home
    source = resolve_model(settings.model, home=home)
    runner, tokenizer, kv_cache_tokens = build_runner(settings, source, home=home)
    return EngineParts(
        runner,
        tokenizer,
        kv_cache_tokens,
        settings.served_model_name or default_served_name(settings.model),
        load_generation_defaults(
            settings.generation_config, source, settings.override_generation_config
        ),
    )


def build_runner(
    settings: EngineSettings,
    source: str,
    memory: MemorySources = SYSTEM,
    *,
    home: Path | None = None,
) -> tuple[ModelRunner, Tokenizer, int]:
    """Load the model for ``settings`` and size the KV cache.

    Returns the runner, the tokenizer and the KV capacity in tokens: ``kv_cache_tokens`` if
    set (never more than the slot rows hold), else as many slot rows of ``max_model_len`` as
    ``kv_cache_memory_fraction`` of the memory available after loading holds, at most
    ``max_batch_size`` (see :mod:`slotserve.engine.core.memory`). ``runner.max_rows`` is the
    number of slots; ``runner.num_slots`` the KV rows (more with ``prefix_cache_rows``, which
    must fit the same budget). ``home``: ``SLOTSERVE_HOME`` (read from the environment if not
    given).
    """
    home = home or CommonSettings().home
    if settings.num_threads is not None:
        torch.set_num_threads(settings.num_threads)
    load_start = time.perf_counter()
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    decode_step = pick_decode_step(settings.decode_step, device)
    static = is_static(decode_step)
    # The static step runs stock products: it needs no kernels (unless a quantization asks for
    # them, which prepare_model then refuses with the static step).
    kernels = (
        None
        if static and settings.quantization == "none"
        else find_kernels(device, dtype, home, quantization=settings.quantization)
    )
    # Before the model loads: a cache dtype this load cannot run is refused at once.
    kv_dtype = pick_kv_dtype(
        settings.kv_cache_dtype, model_dtype=dtype, kernels=kernels, static=static
    )
    model, tokenizer = load_model(source, device, dtype)
    if static:
        fuse_before_sizing(model)  # the free memory read below is then what stays free
    shape = ModelShape.from_config(model.config)
    max_model_len = settings.max_model_len or min(
        shape.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
    )
    if max_model_len > shape.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's "
            f"{shape.max_position_embeddings} positions"
        )
    check_window(model.config, max_model_len)
    num_rows = settings.num_kv_rows
    spare = num_rows > settings.max_batch_size
    # Spare rows are checked against the memory even beside an explicit kv_cache_tokens: that
    # bounds the running sequences' tokens, not the rows.
    available = (
        0
        if settings.kv_cache_tokens is not None and not spare
        else available_memory_bytes(device, memory)
    )
    budget = settings.kv_cache_memory_fraction * available
    step_tokens = settings.step_token_budget(device.type)
    if device.type == "cuda" and settings.kv_cache_tokens is None:
        headroom = headroom_bytes(
            model.config,
            dtype,
            max_batched_tokens=step_tokens,
            max_model_len=max_model_len,
            num_slots=settings.max_batch_size,
        )
        budget = kv_budget_bytes(available, headroom, settings.kv_cache_memory_fraction)
    size = size_kv_cache(
        max_batch_size=settings.max_batch_size,
        max_model_len=max_model_len,
        bytes_per_token=shape.kv_bytes_per_token(kv_dtype),
        budget_bytes=budget,
        kv_cache_tokens=settings.kv_cache_tokens,
    )
    if spare:
        problem = spare_rows_problem(
            num_rows=num_rows,
            max_model_len=max_model_len,
            bytes_per_token=shape.kv_bytes_per_token(kv_dtype),
            budget_bytes=budget,
        )
        if problem is not None:
            raise UnsupportedSettingError(problem)
    else:
        num_rows = size.num_slots
    if size.num_slots < settings.max_batch_size:
        logger.warning(
            "the KV budget (%.0f%% of %.1f GiB available) holds %d of %d slots of %d positions;"
            " raise kv_cache_memory_fraction or the memory limit, or lower max_model_len",
            100 * settings.kv_cache_memory_fraction,
            available / 2**30,
            size.num_slots,
            settings.max_batch_size,
            max_model_len,
        )
    prepared = prepare_model(
        model,
        kernels,
        max_rows=size.num_slots,
        calibration=CalibrationCache(home / "calibration"),
        linear_backend=settings.linear_backend,
        quantization=settings.quantization,
        decode_step=decode_step,
        prefill_dtype=settings.prefill_dtype,
        decode_dtype=settings.decode_dtype,
    )
    runner = ModelRunner(
        prepared,
        kv_dtype=kv_dtype,
        num_slots=num_rows,
        max_rows=size.num_slots,
        max_model_len=max_model_len,
        overlap_steps=pick_overlap_steps(settings.overlap_steps, decode_step, device),
    )
    seconds = time.perf_counter() - load_start
    _log_load(runner, source, device, dtype, seconds, size.num_tokens, step_tokens)
    return runner, tokenizer, size.num_tokens


def _log_load(
    runner: ModelRunner,
    source: str,
    device: torch.device,
    dtype: torch.dtype,
    seconds: float,
    kv_tokens: int,
    step_tokens: int,
) -> None:
    if runner.static is not None:
        logger.info(
            "static decode step (%s, overlapped %s): %d row buckets %s, %d graphs compiled at"
            " load in %.1f s",
            runner.decode_step,
            runner.overlap_steps,
            len(runner.static.row_buckets),
            list(runner.static.row_buckets),
            runner.static.stats.num_compiles,
            runner.static.stats.warm_up_seconds,
        )
    for record in runner.calibrations:
        logger.info(
            "calibrated at load: %s=%s (%s, %.3f s) %s",
            record.name,
            record.choice,
            record.source,
            record.seconds,
            {name: round(value, 3) for name, value in record.figures.items()},
        )
    logger.info(
        "loaded %s on %s/%s in %.1f s (%d calibrations, %.2f s): %d slots, %d KV rows"
        " (prefix_cache_rows) x %d positions, KV budget %d tokens, KV cache in %s,"
        " %d-token steps",
        source,
        device,
        dtype,
        seconds,
        len(runner.calibrations),
        sum(record.seconds for record in runner.calibrations),
        runner.max_rows,
        runner.num_slots,
        runner.max_model_len,
        kv_tokens,
        runner.kv_cache_dtype,
        step_tokens,
    )
