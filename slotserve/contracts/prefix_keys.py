"""Prefix keys: a request's prompt as a short chain of hashes, the same in gateway and engine.

Prefix-aware routing (docs/gateway.md) needs to know which engine holds which prompt prefix
without the gateway tokenizing anything. Both parts turn a request into a chain of keys with
these pure functions: key ``k`` hashes everything up to and including piece ``k`` (a chat
message; a fixed block of prompt characters or token ids), so two prompts that share their first
``k`` pieces share their first ``k`` keys, whatever follows. The engine reports the keys its slot
rows hold (``EngineLoadReport.prefix_keys``); the gateway matches a request's chain against them.
The idea is vLLM's chained block hashes (its KV events, which llm-d's prefix scorer reads), at
the grain of messages and character blocks instead of tokens; written here from that idea.

A key only steers routing: the engine still compares tokens before it reuses a row, so a wrong or
stale key costs a cache miss, never a wrong answer. Keys are salted with the request's cache salt
(its tenant, and a client's own ``cache_salt``) exactly as the engine salts its rows, so one
tenant's keys never match, or say anything about, another tenant's prompts (DESIGN invariant 9).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

# Deeper prefixes are cut here: a chain is at most this many keys (the first pieces).
MAX_PREFIX_KEYS = 32
TEXT_BLOCK_CHARS = 512  # ~100-150 tokens of English a block
TOKEN_BLOCK_IDS = 128
KEY_BYTES = 8  # 16 hex characters: collisions cost a cache miss only
KEY_PATTERN = re.compile(r"^[0-9a-f]{16}$")
_SEED = b"slotserve-prefix-v1\x00"

ChainKind = Literal["chat", "text", "tokens", "none"]


@dataclass(frozen=True)
class PrefixChain:
    """A request's prefix keys, and what its answer extends them with (``with_answer``).

    ``tail`` (text prompts): the characters after the last full block, so the keys of prompt +
    answer can be computed without the prompt; ``last`` is the running hash that the next piece
    extends (hex; for a chat chain, that of its last message, even past ``MAX_PREFIX_KEYS``).
    """

    kind: ChainKind
    keys: tuple[str, ...] = ()
    last: str = ""
    tail: str = ""


NO_CHAIN = PrefixChain("none")


def salt_of(gateway_salt: str | None, client_salt: str | None) -> str:
    """The salt keys are made under: the engine's own rule for its rows' salt
    (``cache_salt_of``: the tenant, then the client's ``cache_salt`` within it)."""
    if gateway_salt is None:
        return client_salt or ""
    return gateway_salt if client_salt is None else f"{gateway_salt}\x1f{client_salt}"


def _start(salt: str) -> bytes:
    return hashlib.blake2b(_SEED + salt.encode("utf-8", "replace"), digest_size=KEY_BYTES).digest()


def _next(previous: bytes, piece: bytes) -> bytes:
    return hashlib.blake2b(previous + piece, digest_size=KEY_BYTES).digest()


def _canonical_content(content: object) -> object:
    # A list of text parts and the same text as one string render alike in chat templates.
    if isinstance(content, list) and all(
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(str(part["text"]) for part in content)
    return content


def message_piece(message: object) -> bytes:
    """One chat message as bytes that two equal messages share: role, content (text parts
    joined), name and tool fields; fields set to null count as absent."""
    if not isinstance(message, Mapping):
        return json.dumps(message, sort_keys=True, default=str).encode()
    canonical = {
        key: _canonical_content(value) if key == "content" else value
        for key, value in message.items()
        if key in ("role", "content", "name", "tool_calls", "tool_call_id") and value is not None
    }
    text = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "replace")


def chat_chain(messages: object, salt: str) -> PrefixChain:
    """One key per message (the first ``MAX_PREFIX_KEYS``); ``NO_CHAIN`` for what is not a
    list of messages."""
    if not isinstance(messages, list) or not messages:
        return NO_CHAIN
    state, keys = _start(salt), list[str]()
    for message in messages:
        state = _next(state, message_piece(message))
        if len(keys) < MAX_PREFIX_KEYS:
            keys.append(state.hex())
    return PrefixChain("chat", tuple(keys), state.hex())


def text_chain(prompt: str, salt: str) -> PrefixChain:
    """One key per full block of ``TEXT_BLOCK_CHARS`` characters."""
    state, keys = _start(salt), list[str]()
    num_blocks = len(prompt) // TEXT_BLOCK_CHARS
    for index in range(min(num_blocks, MAX_PREFIX_KEYS)):
        block = prompt[index * TEXT_BLOCK_CHARS : (index + 1) * TEXT_BLOCK_CHARS]
        state = _next(state, block.encode("utf-8", "replace"))
        keys.append(state.hex())
    if num_blocks > MAX_PREFIX_KEYS:  # past the bound: no tail to extend
        return PrefixChain("text", tuple(keys), state.hex(), "")
    return PrefixChain("text", tuple(keys), state.hex(), prompt[num_blocks * TEXT_BLOCK_CHARS :])


def token_chain(token_ids: list[int], salt: str) -> PrefixChain:
    """One key per full block of ``TOKEN_BLOCK_IDS`` token ids (no answer extension)."""
    state, keys = _start(salt), list[str]()
    num_blocks = min(len(token_ids) // TOKEN_BLOCK_IDS, MAX_PREFIX_KEYS)
    for index in range(num_blocks):
        block = token_ids[index * TOKEN_BLOCK_IDS : (index + 1) * TOKEN_BLOCK_IDS]
        state = _next(state, ",".join(str(int(i)) for i in block).encode())
        keys.append(state.hex())
    return PrefixChain("tokens", tuple(keys), state.hex())


def request_chain(chat: bool, payload: Mapping[str, object], salt: str) -> PrefixChain:
    """The chain of a chat or completions request body (a single prompt only: a batch of
    prompts, or anything malformed, has none and is routed by load)."""
    try:
        return _request_chain(chat, payload, salt)
    except (RecursionError, ValueError, TypeError):  # a body nested past what dumps takes
        return NO_CHAIN


def _request_chain(chat: bool, payload: Mapping[str, object], salt: str) -> PrefixChain:
    if chat:
        return chat_chain(payload.get("messages"), salt)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_chain(prompt, salt)
    if isinstance(prompt, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in prompt
    ):
        return token_chain(prompt, salt)
    return NO_CHAIN


def with_answer(chain: PrefixChain, answer: str) -> tuple[str, ...]:
    """The keys a slot row holds once ``answer`` was generated after the chain's prompt: for
    chat, the conversation with the answer as the next assistant message (what a client sends
    as its next turn's history); for text, the blocks of prompt + answer."""
    if chain.kind == "chat" and chain.last:
        if len(chain.keys) >= MAX_PREFIX_KEYS:
            return chain.keys
        piece = message_piece({"role": "assistant", "content": answer})
        return (*chain.keys, _next(bytes.fromhex(chain.last), piece).hex())
    if chain.kind == "text" and chain.last and len(chain.keys) < MAX_PREFIX_KEYS:
        state, keys, rest = bytes.fromhex(chain.last), list(chain.keys), chain.tail + answer
        while len(rest) >= TEXT_BLOCK_CHARS and len(keys) < MAX_PREFIX_KEYS:
            state = _next(state, rest[:TEXT_BLOCK_CHARS].encode("utf-8", "replace"))
            keys.append(state.hex())
            rest = rest[TEXT_BLOCK_CHARS:]
        return tuple(keys)
    return chain.keys


def deepest_match(chain: tuple[str, ...], held: frozenset[str] | set[str]) -> int:
    """How many leading keys of ``chain`` an index holds: the depth of the deepest held key
    (0: none). Keys chain, so the deepest one held implies its whole prefix."""
    for depth in range(len(chain), 0, -1):
        if chain[depth - 1] in held:
            return depth
    return 0


def is_key(value: object) -> bool:
    return isinstance(value, str) and KEY_PATTERN.match(value) is not None
