"""The command line of one engine process: ``slotserve engine`` and its flags, built in one place.

The operator (a pool's Deployment) and ``slotserve up``/``demo`` (local processes) both start
engines through :func:`engine_argv`. Flag names follow the engine's rule, one flag per
``EngineSettings`` field (``max_batch_size`` -> ``--max-batch-size``, :func:`flag_name`), and a
test parses what this builds with the engine's own parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.contracts.pool_spec import BatchingSpec
from slotserve.contracts.weights import DType, Quantization  # core imports these from here too

ENGINE_PORT = 8000


def flag_name(field: str) -> str:
    """The engine flag of an ``EngineSettings`` field."""
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class EngineLaunch:
    """What one engine is started with; ``None`` leaves a setting at the engine's default."""

    model: str
    served_model_name: str
    batching: BatchingSpec
    host: str = "0.0.0.0"
    port: int = ENGINE_PORT
    max_model_len: int | None = None
    dtype: DType | None = None
    drain_timeout_seconds: float | None = None
    generation_config: str | None = None
    tool_call_parser: str | None = None
    override_generation_config: str | None = None  # a JSON object
    kv_cache_tokens: int | None = None
    num_threads: int | None = None
    quantization: Quantization | None = None
    device: str | None = None
    prefix_cache_rows: int | None = None


def engine_argv(launch: EngineLaunch) -> list[str]:
    """``engine`` and its flags: the arguments of the ``slotserve`` command."""
    batching = launch.batching
    # The operator's order since v1alpha1: a changed order would roll every pool's pods.
    values: list[tuple[str, object]] = [
        ("model", launch.model),
        ("served_model_name", launch.served_model_name),
        ("host", launch.host),
        ("port", launch.port),
        ("policy", batching.policy),
        ("max_batch_size", batching.max_batch_size),
        ("max_queue_delay_microseconds", batching.max_queue_delay_microseconds),
        ("max_batched_tokens", batching.max_batched_tokens),
        ("max_model_len", launch.max_model_len),
        ("dtype", launch.dtype),
        ("drain_timeout_seconds", launch.drain_timeout_seconds),
        ("preferred_batch_sizes", batching.preferred_batch_sizes),
        ("generation_config", launch.generation_config),
        ("tool_call_parser", launch.tool_call_parser),
        ("override_generation_config", launch.override_generation_config),
        ("kv_cache_tokens", launch.kv_cache_tokens),
        ("num_threads", launch.num_threads),
        # Appended last, and None (no flag) for "none", so that adding it rolled no pods.
        ("quantization", launch.quantization),
        ("device", launch.device),
        # Last, and None for 0 (one row per slot): pools made before it keep their args.
        ("prefix_cache_rows", launch.prefix_cache_rows),
    ]
    argv = ["engine"]
    for field, value in values:
        if isinstance(value, list):
            if value:  # an empty list is the engine's default: no flag
                argv += [flag_name(field), *map(str, value)]
        elif value is not None:
            argv += [flag_name(field), str(value)]
    return argv
