"""The prefix keys gateway and engine both compute (``contracts.prefix_keys``): shared prefixes
share keys, the salt separates tenants, chains are bounded, hostile bodies give no keys."""

from __future__ import annotations

from slotserve.contracts.prefix_keys import (
    MAX_PREFIX_KEYS,
    NO_CHAIN,
    TEXT_BLOCK_CHARS,
    chat_chain,
    deepest_match,
    is_key,
    request_chain,
    salt_of,
    text_chain,
    token_chain,
    with_answer,
)

SYSTEM = {"role": "system", "content": "You are terse."}


def test_chat_keys_chain_messages_and_the_answer_extends_them():
    first = [SYSTEM, {"role": "user", "content": "hi"}]
    chain = chat_chain(first, "")
    assert len(chain.keys) == 2 and all(is_key(key) for key in chain.keys)
    follow = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    follow_keys = chat_chain(follow, "").keys
    assert follow_keys[:3] == with_answer(chain, "hello")
    assert deepest_match(follow_keys, set(with_answer(chain, "hello"))) == 3
    # Another conversation with the same system prompt shares exactly the first key.
    other = chat_chain([SYSTEM, {"role": "user", "content": "bye"}], "").keys
    assert deepest_match(other, set(chain.keys)) == 1
    assert deepest_match(other, set()) == 0


def test_canonical_content_and_nulls():
    as_text = chat_chain([{"role": "user", "content": "a b"}], "").keys
    as_parts = [
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}
    ]
    assert chat_chain(as_parts, "").keys == as_text
    assert chat_chain([{"role": "user", "content": "a b", "name": None}], "").keys == as_text
    assert chat_chain([{"role": "assistant", "content": "a b"}], "").keys != as_text


def test_salt_separates_tenants_as_the_engine_does():
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    a, b = chat_chain(messages, "tenant-a").keys, chat_chain(messages, "tenant-b").keys
    assert not set(a) & set(b)
    assert salt_of("team-a", None) == "team-a"
    assert salt_of("team-a", "own") != salt_of("own", None)
    assert salt_of(None, None) == ""


def test_text_and_token_blocks_and_bounds():
    prompt = "x" * (TEXT_BLOCK_CHARS * 3 + 10)
    chain = text_chain(prompt, "")
    assert len(chain.keys) == 3 and chain.tail == "x" * 10
    # Prompt + answer: the blocks of the concatenation, as a follow-up prompt computes them.
    answer = "y" * TEXT_BLOCK_CHARS
    assert with_answer(chain, answer) == text_chain(prompt + answer, "").keys
    assert len(text_chain("z" * TEXT_BLOCK_CHARS * 100, "").keys) == MAX_PREFIX_KEYS
    assert len(token_chain(list(range(128 * 2 + 5)), "").keys) == 2
    many = [{"role": "user", "content": str(i)} for i in range(100)]
    assert len(chat_chain(many, "").keys) == MAX_PREFIX_KEYS


def test_hostile_bodies_give_no_keys():
    assert request_chain(True, {"messages": "not a list"}, "") == NO_CHAIN
    assert request_chain(True, {"messages": []}, "") == NO_CHAIN
    assert request_chain(False, {"prompt": ["a", "b"]}, "") == NO_CHAIN  # a batch
    assert request_chain(False, {"prompt": [1, True]}, "") == NO_CHAIN
    assert request_chain(False, {"prompt": {"x": 1}}, "") == NO_CHAIN
    # Odd message shapes still hash (and match only themselves).
    assert len(request_chain(True, {"messages": [1, None, {"role": 5}]}, "").keys) == 3
    deep: list = []
    for _ in range(100_000):  # past what json.dumps recurses into
        deep = [deep]
    assert request_chain(True, {"messages": [{"role": "user", "content": deep}]}, "") == NO_CHAIN
    assert not is_key("ABCDEF0123456789") and not is_key("x" * 16) and is_key("0" * 16)
