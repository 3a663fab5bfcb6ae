"""The key table in ``slotserve.contracts.redis_keys`` lists every key and stats field the
scripts write (the operator and people reading Redis go by it)."""

from __future__ import annotations

import re

from slotserve.contracts import redis_keys
from slotserve.gateway.admission.lua.scripts import SCRIPTS


def test_every_pool_key_and_stats_field_the_scripts_write_is_in_the_table():
    table = redis_keys.__doc__ or ""
    for name in redis_keys.POOL_KEY_NAMES:
        assert f"``P:{{pool}}:{name}``" in table, name
    source = "\n".join(SCRIPTS.values())
    fields = set(re.findall(r"'(?:HINCRBY|HSET)', K_STATS, '([a-z_]+)'", source))
    fields |= set(re.findall(r"'HSET', K_STATS, '[a-z_]+', [^,]+, '([a-z_]+)'", source))
    assert {"dispatched", "held", "bad_entries", "refused", "retry_horizon"} <= fields
    for name in fields:
        assert f"``{name}``" in table, f"stats field {name!r} is not in the key table"
