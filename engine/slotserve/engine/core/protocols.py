"""What the engine asks of its model runner and its tokenizer.

The engine and the async engine hold these instead of the concrete classes: the pure Python core
reads without torch (``ModelRunner``, the one implementation, lives in ``runner.py``) or
transformers (whose fast tokenizers have every member below), and a benchmark may hand in a
runner of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from slotserve.engine.core.logprobs import SampledLogprobs
    from slotserve.engine.core.model.calibration import CalibrationRecord
    from slotserve.engine.core.prefix_cache import SlotCopy
    from slotserve.engine.core.scheduler import ScheduledChunk
    from slotserve.engine.core.sequence import SequenceError


class Tokenizer(Protocol):
    """The members of a transformers tokenizer that the engine uses."""

    # The Jinja source of the model's chat template, if it has one (transformers also allows a
    # dict of named templates).
    chat_template: str | dict[str, str] | None

    def encode(
        self,
        text: str,
        *,
        add_special_tokens: bool = ...,
        truncation: bool = ...,
        max_length: int | None = ...,
    ) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = ...,
        tokenize: bool = ...,
        add_generation_prompt: bool = ...,
    ) -> Any: ...


class VocabularyShape(Protocol):
    @property
    def vocab_size(self) -> int: ...


class Launcher(Protocol):
    """Steps started without waiting for their result (:mod:`slotserve.engine.core.overlap`)."""

    @property
    def last_logprobs(self) -> Sequence[SampledLogprobs | None]:
        """The last ``execute``'s or ``collect``'s logprobs, one entry per sampled row."""
        ...

    def can_launch(self, chunks: Sequence[ScheduledChunk], *, chained: bool = ...) -> bool:
        """Whether :meth:`launch` can run ``chunks``; ``chained``: with input tokens that the
        step launched just before is still sampling."""
        ...

    def launch(
        self, chunks: Sequence[ScheduledChunk], previous_rows: Sequence[int] | None = ...
    ) -> Any:
        """Start a step; ``previous_rows[i]``: the previous launch's row whose token is chunk
        ``i``'s input. Returns a handle for :meth:`collect`."""
        ...

    def collect(self, launched: Any) -> list[int | SequenceError]:
        """Wait for a launched step: a token id, or that row's own failure, per row."""
        ...


class Runner(Launcher, Protocol):
    """Runs the model for one step's chunks and owns the KV rows of its slots."""

    @property
    def model(self) -> object:
        """The loaded model (its generation config names end-of-sequence tokens)."""
        ...

    @property
    def shape(self) -> VocabularyShape: ...

    @property
    def num_slots(self) -> int:
        """KV rows allocated: may be fewer than ``max_batch_size`` when memory holds fewer."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def device_type(self) -> str:
        """Where the model runs: ``cpu``, ``cuda`` or ``mps`` (device-dependent defaults)."""
        ...

    @property
    def overlap_steps(self) -> bool:
        """Whether the engine overlaps static decode steps (the runner then launches them)."""
        ...

    @property
    def calibrations(self) -> Sequence[CalibrationRecord]: ...

    @property
    def kv_cache_dtype(self) -> str:
        """What the KV cache stores keys and values in (``float16``, ``float32``, ...)."""
        ...

    def copy_prefixes(self, copies: Sequence[SlotCopy]) -> None: ...

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[int | SequenceError]:
        """One forward over ``chunks``: a token id, or that row's own failure, per sampled row."""
        ...
