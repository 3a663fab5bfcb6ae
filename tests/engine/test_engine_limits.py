"""RequestLimits: each bound a request meets, with the error (and parameter) a client sees."""

from __future__ import annotations

import pytest

from slotserve.engine.core.errors import InvalidRequestError, QueueFullError
from slotserve.engine.core.limits import RequestLimits

LIMITS = RequestLimits(
    max_model_len=100, kv_cache_tokens=80, vocab_size=50, num_slots=4, max_waiting=2
)


def test_room_after_the_prompt_is_bounded_by_the_model_and_the_kv_cache():
    assert LIMITS.max_sequence_tokens == 80
    assert LIMITS.room_after(30) == 50
    assert LIMITS.room_after(80) == 1  # never zero: the length check then refuses it


@pytest.mark.parametrize(
    ("check", "param", "message"),
    [
        (lambda: LIMITS.check_not_empty(""), "prompt", "must not be empty"),
        (lambda: LIMITS.check_not_empty([]), "prompt", "must not be empty"),
        (lambda: LIMITS.check_prompt_ids([1, 50]), "prompt", "[0, 50)"),
        (lambda: LIMITS.check_prompt_ids([1, -1]), "prompt", "[0, 50)"),
        (lambda: LIMITS.check_prompt_ids([1, "2"]), "prompt", "integers"),
        (lambda: LIMITS.check_length(60, 41), "max_tokens", "maximum context length is 100"),
        (lambda: LIMITS.check_length(60, 21), "max_tokens", "exceeds the KV cache (80"),
        (lambda: LIMITS.check_logit_bias({3: 1.0, 50: 2.0}), "logit_bias", "vocabulary size 50"),
        (lambda: LIMITS.check_num_choices(5), "n", "'n' (5) exceeds this engine's 4 slots"),
    ],
)
def test_each_limit_names_its_parameter(check, param, message):
    with pytest.raises(InvalidRequestError) as raised:
        check()
    assert raised.value.param == param and message in raised.value.message


def test_requests_within_the_limits_pass():
    LIMITS.check_not_empty("x")
    LIMITS.check_prompt_ids([0, 49])
    LIMITS.check_length(60, 20)
    LIMITS.check_logit_bias({0: 1.0, 49: -1.0})
    LIMITS.check_num_choices(4)
    LIMITS.check_queue_room(1)


def test_a_full_waiting_queue_is_queue_full():
    with pytest.raises(QueueFullError, match="2 requests are already waiting"):
        LIMITS.check_queue_room(2)
