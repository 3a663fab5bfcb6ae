"""Each Lua script reads its own arguments by name, bound from its args dataclass
(``admission/lua/args.py``), and spells no key by hand (``redis_keys.Keys`` builds them)."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
import redis

from slotserve.contracts.redis_keys import ScriptArgs
from slotserve.gateway.admission.lua import quotas, scripts
from slotserve.gateway.admission.lua.args import (
    CancelArgs,
    ChargeArgs,
    EnqueueArgs,
    HeartbeatArgs,
    RefreshArgs,
    ReleaseArgs,
    TakeArgs,
)
from slotserve.gateway.admission.lua.prelude import PRELUDE
from tests.support import RedisServer

SOURCES = {**scripts.SCRIPTS, **quotas.SCRIPTS}
ARGS = {**scripts.SCRIPT_ARGS, **quotas.SCRIPT_ARGS}


def bound_name(field_name: str, field_type: object) -> str:
    suffix = "_AT" if str(field_type).startswith("tuple") else ""
    return f"ARG_{field_name.upper()}{suffix}"


def test_every_script_has_an_args_dataclass() -> None:
    assert set(ARGS) == set(SOURCES)


def own_part(source: str) -> str:
    """What a script adds to the shared prelude, less the lines that bind its arguments."""
    own = source.removeprefix(PRELUDE)
    return "\n".join(line for line in own.splitlines() if not line.startswith("local ARG_"))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_script_binds_exactly_its_args_fields_and_reads_each(name: str) -> None:
    source, args = SOURCES[name], ARGS[name]
    expected = [bound_name(field.name, field.type) for field in fields(args)]
    bound = re.findall(r"^local (ARG_\w+) = ", source, re.MULTILINE)
    assert bound == expected, "bound in field order, each once"
    used = set(re.findall(r"\bARG_\w+", source))
    assert used == set(expected), "no argument read that is not bound"
    for local in expected:
        assert re.search(rf"\b{local}\b", own_part(source)), f"{local} is bound, never read"
    # No argument is found by counting positions: only the items of a variadic tail are
    # indexed, from its named start.
    assert not re.search(r"ARGV\[(REST|\d+)", own_part(source))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_no_script_indexes_keys_or_spells_a_tenant_key(name: str) -> None:
    """KEYS are bound once, by name, from the contract's key order (``lua_key_locals``); the
    keys a script builds come from ``redis_keys.lua_key``."""
    lines = SOURCES[name].splitlines()
    indexed = [line for line in lines if re.search(r"KEYS\[\d+\]", line)]
    assert all(re.fullmatch(r"local K_[A-Z_]+ = KEYS\[\d+\]", line) for line in indexed)
    assert ":tenant:" not in SOURCES[name]


ARGUMENTS: list[ScriptArgs] = [
    EnqueueArgs(
        request_id="r1",
        priority=2,
        timeout_us=3,
        max_queue_size=4,
        only_if_absent=True,
        drain_gap_us=5,
        queue_timeout_us=6,
        aging_us=7,
        level_max_queue_size=8,
        demote_after_us=9,
        slots=10,
        tenant="t",
        weight=11,
        deadline_gap_us=12,
    ),
    CancelArgs("r2"),
    ReleaseArgs(("a", "b", "c")),
    HeartbeatArgs("p", "r", 1, 2, "e", False, ("m", 1, "x", "http://e", 1)),
    TakeArgs("r3", -1, 2, 3, 4, 5),
    ChargeArgs(1, -2),
    RefreshArgs(7, ("a", "b")),
]


@pytest.mark.parametrize("args", ARGUMENTS, ids=lambda args: type(args).__name__)
def test_each_local_reads_the_value_argv_put_there(
    redis_server: RedisServer, args: ScriptArgs
) -> None:
    """Through real Redis, after three leading arguments (as the offers and shared ones come
    first in a dispatching script): every ``ARG_*`` local holds its field's value."""
    reads = []
    for field in fields(args):
        local = bound_name(field.name, field.type)
        reads.append(f"ARGV[{local}]" if local.endswith("_AT") else local)
    script = args.lua_args("REST") + f"return {{{', '.join(reads)}}}"
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        reply = client.eval("local REST = 4\n" + script, 0, "x", "y", "z", *args.argv())
    finally:
        client.close()
    expected = []
    for field in fields(args):
        value = getattr(args, field.name)
        first = value[0] if isinstance(value, tuple) else value
        expected.append(str(int(first) if isinstance(first, bool) else first))
    assert reply == expected
