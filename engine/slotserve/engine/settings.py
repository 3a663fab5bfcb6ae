"""The engine's one settings object (env prefix ``SLOTSERVE_ENGINE_``), built once at start-up."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from slotserve.contracts.pool_spec import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS,
    DEFAULT_POLICY,
    BatchingSpec,
    MaxBatchedTokens,
    MaxBatchSize,
    MaxQueueDelayMicroseconds,
    Policy,
    PreferredBatchSizes,
    PrefixCacheRows,
    default_max_batched_tokens,
    preferred_sizes_fit,
    prefix_cache_rows_fit,
)
from slotserve.contracts.weights import WeightDType, WeightQuantization
from slotserve.engine.core.generation_defaults import parse_override
from slotserve.engine.core.tool_parsers import ToolParserName

LinearBackend = Literal["auto", "onednn", "aten", "native"]
DecodeStep = Literal["auto", "classic", "static", "compiled"]
OverlapSteps = Literal["auto", "on", "off"]
PrefillDType = Literal["auto", "float32", "bfloat16", "int16"]
DecodeDType = PrefillDType
KVCacheDType = Literal["auto", "float32", "float16"]


class EngineSettings(BaseSettings):
    """Everything one engine process needs: model, batching policy, KV budget, HTTP server."""

    model_config = SettingsConfigDict(env_prefix="SLOTSERVE_ENGINE_", extra="ignore")

    model: str = Field("smollm2", min_length=1, description="Name, local HF folder or hub id.")
    served_model_name: str | None = Field(None, description="Name clients send in `model`.")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|mps|cuda(:[0-9]+)?)$",
        description="auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps; told cuda, "
        "the engine exits 2 when it finds no usable GPU",
    )
    dtype: WeightDType = "auto"
    # The batching fields: declared once in slotserve.contracts.pool_spec (the CRD's too).
    policy: Policy = DEFAULT_POLICY
    max_batch_size: MaxBatchSize = DEFAULT_MAX_BATCH_SIZE
    max_queue_delay_microseconds: MaxQueueDelayMicroseconds = DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS
    preferred_batch_sizes: PreferredBatchSizes = Field(default_factory=list)
    max_batched_tokens: MaxBatchedTokens | None = None  # by device: step_token_budget
    max_model_len: int | None = Field(None, ge=2, description="Prompt + output tokens at most.")
    kv_cache_tokens: int | None = Field(None, ge=2, description="KV capacity in tokens.")
    kv_cache_memory_fraction: float = Field(0.5, gt=0.0, le=1.0)
    max_waiting: int = Field(1024, ge=0, description="Waiting requests beyond: QueueFullError.")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads.")
    linear_backend: LinearBackend = Field(
        "auto",
        description="CPU matrix products: auto (measured at start), onednn, aten, or native "
        "(the engine's own kernels for every decode step).",
    )
    quantization: WeightQuantization = "none"
    decode_step: DecodeStep = Field(
        "auto",
        description="Decode-only steps: auto (compiled on CUDA, classic elsewhere), classic "
        "(the native C step on CPU, else transformers' forward), static (the graph-capturable "
        "step, eager) or compiled (that step through torch.compile; CUDA graphs on CUDA).",
    )
    prefill_dtype: PrefillDType = Field(
        "auto",
        description="CPU prefill products (chunks wider than the native kernels take): auto "
        "(bfloat16 on CPUs with AMX-BF16 or AVX512_BF16 and native fp32 layers, or int8/int4 "
        "layers where the native kernels run AVX512_BF16; int16 on CPUs with AVX512_VNNI and no "
        "bf16 units and native fp32 layers; else float32), float32, bfloat16 "
        "(bf16 weight copies, or int8/int4 weights widened to bf16 as they are multiplied; "
        "activations rounded to bf16, fp32 accumulation; refused with a warning where the CPU "
        "would emulate it), or int16 "
        "(int16 weight copies and activations multiplied by VPDPWSSD, exact integer sums per "
        "64 columns, fp32 accumulation, engine/core/model/int16_products.py; refused with a "
        "warning without AVX512_VNNI or where the layers are not native fp32). Requests scoring "
        "their prompt (prompt logprobs) stay float32; decode_dtype sets the decode products.",
    )
    decode_dtype: DecodeDType = Field(
        "auto",
        description="CPU decode products (rows the native kernels take: decode rows, small "
        "chunks) and the output projection: auto (bfloat16 where the native kernels run "
        "AVX512_BF16; int16 on CPUs with AVX512_VNNI and no bf16 units; else float32), float32, "
        "bfloat16 (bf16 weight copies multiplied by "
        "VDPBF16PS, or int8/int4 weights widened to bf16 in steps of 12 rows or more; rows "
        "rounded to bf16, fp32 accumulation; refused with a warning where the CPU lacks "
        "AVX512_BF16), or int16 (the decoder's products as prefill_dtype int16's, the output "
        "projection in fp32; refused with a warning without AVX512_VNNI). int16 on one side "
        "turns bf16 off on the other (one set of narrow weights). Requests scoring their prompt "
        "(prompt logprobs) stay float32.",
    )
    kv_cache_dtype: KVCacheDType = Field(
        "auto",
        description="Keys and values as the KV cache stores them: auto (float16 where the "
        "native CPU kernels read the cache, else the weights' dtype), float32, or float16 "
        "(half the bytes a position: decode attention reads half as much memory and the same "
        "memory holds twice the tokens; sums stay fp32; refused where the native kernels do "
        "not run).",
    )
    overlap_steps: OverlapSteps = Field(
        "auto",
        description="Static decode steps: launch step N+1 (its input tokens taken on the "
        "device) before postprocessing step N: on, off, or auto (on with the compiled step on "
        "CUDA, where the host's work then hides behind the device's; off elsewhere).",
    )
    generation_config: str = Field(
        "auto",
        min_length=1,
        description="Sampling defaults for fields a request leaves out: auto (the model's "
        "generation_config.json), none (OpenAI's defaults) or a folder holding that file.",
    )
    override_generation_config: str | None = Field(
        None,
        description='JSON object over the generation config, e.g. {"temperature": 0.7}.',
    )
    tool_call_parser: ToolParserName = Field(
        "auto",
        description="How the model writes tool calls: hermes, llama3_json, or auto (from the "
        "chat template).",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV of a prompt prefix that a slot row already holds."
    )
    prefix_cache_rows: PrefixCacheRows = 0
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    drain_timeout_seconds: float = Field(30, ge=0)
    max_request_body_bytes: int = Field(1_048_576, ge=1024)

    @field_validator("override_generation_config")
    @classmethod
    def _override_is_a_generation_config(cls, value: str | None) -> str | None:
        parse_override(value)  # raises ValueError naming the bad key or value
        return value

    @model_validator(mode="after")
    def _preferred_sizes_fit(self) -> EngineSettings:
        if not preferred_sizes_fit(self.preferred_batch_sizes, self.max_batch_size):
            raise ValueError(
                "every preferred_batch_sizes entry must be between 1 and max_batch_size"
            )
        return self

    @model_validator(mode="after")
    def _prefix_cache_rows_hold_the_slots(self) -> EngineSettings:
        rows = self.prefix_cache_rows
        if not prefix_cache_rows_fit(rows, self.max_batch_size):
            raise ValueError(
                f"prefix_cache_rows ({rows}) must be 0 or at least max_batch_size "
                f"({self.max_batch_size}): every slot needs a row"
            )
        if rows > self.max_batch_size and not self.enable_prefix_caching:
            raise ValueError("prefix_cache_rows beyond max_batch_size needs enable_prefix_caching")
        return self

    @property
    def num_kv_rows(self) -> int:
        """KV rows to allocate: ``prefix_cache_rows``, or one per slot when 0."""
        return max(self.prefix_cache_rows, self.max_batch_size)

    def step_token_budget(self, device_type: str) -> int:
        """``max_batched_tokens``, or the default for ``device_type`` when unset."""
        return self.max_batched_tokens or default_max_batched_tokens(device_type)

    @classmethod
    def from_batching(cls, batching: BatchingSpec, **overrides: object) -> EngineSettings:
        """Settings whose batching fields come from a pool's ``BatchingSpec``."""
        fields = batching.model_dump(by_alias=False)
        fields.update(overrides)
        return cls(**fields)
