"""Every bound a request is checked against, each in one place.

The engine checks a request against these when it is added; the HTTP layer asks the same object
before it gets that far (the default ``max_tokens``, ``n`` against the slots, ``logit_bias``
against the vocabulary), so a limit and its message live here once. Sampling-field bounds are
types in :mod:`slotserve.engine.core.params`; the prompt's character bound, which must be known
before tokenizing, is :class:`~slotserve.engine.core.tokenize.PromptTokenizer`'s.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from slotserve.engine.core.errors import InvalidRequestError, QueueFullError


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can take: fixed once the model is loaded and the KV cache sized."""

    max_model_len: int
    kv_cache_tokens: int
    vocab_size: int
    num_slots: int
    max_waiting: int

    @property
    def max_sequence_tokens(self) -> int:
        """Prompt plus output tokens one sequence may hold: in the model and in the KV cache."""
        return min(self.max_model_len, self.kv_cache_tokens)

    def room_after(self, num_prompt_tokens: int) -> int:
        """The default ``max_tokens``: whatever fits after the prompt (at least one)."""
        return max(1, self.max_sequence_tokens - num_prompt_tokens)

    def check_not_empty(self, prompt: str | Sequence[int]) -> None:
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")

    def check_prompt_ids(self, token_ids: Sequence[object]) -> None:
        """Token ids as a client sent them."""
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in token_ids):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt"
            )

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {num_prompt_tokens} tokens and max_tokens is {max_tokens} ({total})",
                param="max_tokens",
            )
        if total > self.kv_cache_tokens:
            raise InvalidRequestError(
                f"prompt + max_tokens ({total}) exceeds the KV cache "
                f"({self.kv_cache_tokens} tokens)",
                param="max_tokens",
            )

    def check_logit_bias(self, token_ids: Collection[int]) -> None:
        if any(token_id >= self.vocab_size for token_id in token_ids):
            raise InvalidRequestError(
                f"'logit_bias' token ids must be below the vocabulary size {self.vocab_size}",
                param="logit_bias",
            )

    def check_num_choices(self, n: int) -> None:
        if n > self.num_slots:
            raise InvalidRequestError(
                f"'n' ({n}) exceeds this engine's {self.num_slots} slots: each choice takes one",
                param="n",
            )

    def check_queue_room(self, num_waiting: int) -> None:
        if num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests are already waiting")
