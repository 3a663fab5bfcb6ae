"""Per-request sampling parameters, validated at the boundary so bad values never reach the loop."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How one request is decoded; temperature 0 means greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1, description="New tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int | None = Field(None, ge=1, description="Sample among the k most likely tokens.")
    seed: int | None = Field(None, description="Per-request seed for reproducible sampling.")
    stop: list[str] = Field(default_factory=list, max_length=16, description="Stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, stop: list[str]) -> list[str]:
        if any(not text for text in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_not_negative(cls, ids: list[int]) -> list[int]:
        if any(token_id < 0 for token_id in ids):
            raise ValueError("stop_token_ids must not be negative")
        return ids

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
