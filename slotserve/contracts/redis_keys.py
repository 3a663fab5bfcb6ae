"""Every Redis key the gateway writes and the operator reads, in one place.

All keys start with the configured prefix (``SLOTSERVE_GATEWAY_REDIS_PREFIX``, default
``slotserve``). Pool keys carry the pool name in a hash tag (``{model}``) so that one pool's keys
share a cluster slot. Every key has a TTL that each write extends, so an abandoned pool or a dead
replica leaves nothing behind for long:

| key | type | contents | TTL |
|---|---|---|---|
| ``P:{pool}:queue`` | ZSET | waiting request ids; score = arrival + level x aging (4) | STATE |
| ``P:{pool}:entries`` | HASH | id -> ``replica|deadline_us|enqueued_us|level|slots`` | STATE |
| ``P:{pool}:seq`` | STRING | arrival counter (global FIFO order within a priority) | STATE |
| ``P:{pool}:leases`` | ZSET | request ids holding a slot; score = lease expiry (us) | STATE |
| ``P:{pool}:lease_endpoint`` | HASH | request id -> endpoint URL of its slot | STATE |
| ``P:{pool}:inflight`` | HASH | endpoint URL -> slots its leases hold (a request's ``n``) | STATE |
| ``P:{pool}:lease_slots`` | HASH | request id -> slots its lease holds, if over one | STATE |
| ``P:{pool}:stats`` | HASH | counters and promise state (5) | STATE |
| ``P:{pool}:deadlines`` | ZSET | waiting request ids; score = queue deadline (us) | STATE |
| ``P:{pool}:replicas`` | SET | replicas that may have requests waiting in the pool | STATE |
| ``P:{pool}:retries`` | ZSET | places promised to rejected clients; score = return (us) | STATE |
| ``P:{pool}:levels`` | HASH | level -> number of its requests waiting | STATE |
| ``P:{pool}:delays`` | ZSET | DELAY-level request ids; score = when demoted (us) | STATE |
| ``P:{pool}:waiting:{id}`` | ZSET | replica ``id``'s waiting request ids (dead: swept) | STATE |
| ``P:{pool}:fair:{level}`` | HASH | ``=v`` -> virtual time V, tenant -> finish tag (6) | STATE |
| ``P:{pool}:fairq:{level}`` | ZSET | the level's waiting ids; score = fair start tag (6) | STATE |
| ``P:{pool}:routes`` | HASH | waiting request id -> its route (8) | STATE |
| ``P:{pool}:route_waits`` | HASH | ``=room`` -> since when room goes unused for waits (8) | STATE |
| ``P:{pool}:routed:{key}`` | STRING | endpoint a request with prefix ``key`` went to (8) | 5 s |
| ``P:{pool}:session:{id}`` | STRING | endpoint that served session ``id`` last (8) | 10 min |
| ``P:{pool}:row_claims:{url}`` | ZSET | grants taking a new row at ``url``; score = us (8) | 10 s |
| ``P:{pool}:entry_tenants`` | HASH | waiting request id -> its tenant (9) | STATE |
| ``P:{pool}:lease_tenants`` | HASH | request id holding a slot -> its tenant (9) | STATE |
| ``P:{pool}:tenant_held`` | HASH | tenant -> slots its leases hold in the pool (9) | STATE |
| ``P:{pool}:tenant_held_at`` | HASH | tenant ``\\x1f`` URL -> slots held there (9) | STATE |
| ``P:{pool}:tenant_weights`` | HASH | tenant -> its weight, written at enqueue (9) | STATE |
| ``P:{pool}:window:{n}`` | HASH | admitted, rejected, queue waits in window ``n`` (3) | 90 s |
| ``P:epoch`` | HASH | admission epoch: ``id``, ``created``, ``ready`` (us) (2) | STATE |
| ``P:replica:{id}`` | STRING | present while replica ``id`` heartbeats | lease TTL |
| ``P:grants:{id}`` | LIST | grants made for replica ``id`` by others (1) | lease TTL |
| ``P:tenant:{name}:rpm`` | HASH | tenant's requests bucket: ``level``, ``at`` (7) | to full |
| ``P:tenant:{name}:tpm`` | HASH | tenant's tokens bucket: ``level``, ``at`` (7) | to full |
| ``P:tenant:{name}:inflight`` | ZSET | tenant's requests in flight; score = expiry (ms) | (7) |

(1) each item is ``pool``, request id and endpoint joined by ``\\x1f``.
(2) recreated when Redis lost its data; nobody dispatches before ``ready`` (see the gateway's
``admission/lua/scripts.py``).
(3) written by every replica, read by the operator for ``status.admission``
(``slotserve.admission_stats``).
(4) plus ``DEMOTION_OFFSET_US`` once demoted (a ``DELAY`` level's request past its timeout).
(5) ``dispatched`` (granted so far), ``refused`` (queued requests no offered engine could hold),
``bad_entries`` (entries or lease weights that did not parse, dropped), ``held`` (queue places
held for promised clients), ``retry_horizon`` (us: the last place promised), ``settled`` (us:
promises due up to then have opened their places), ``kept`` and ``lapsed`` (promises whose
clients came back within their grace, and those that did not; halved past 64), ``preempting``
(preempting grants made so far, (9)).
(6) start-time fair queuing within a level (``gateway/lua_fair.py``); both deleted when the level
has nothing waiting.
(7) the gateway's ``admission/lua/quotas.py``: a bucket (``at`` in ms) lives until it would have
refilled (absent is full), the in-flight set until no replica refreshed it for its TTL.
(8) prefix-aware routing (the gateway's ``pools/routing.py``, ``admission/lua/routes.py``): a
route is the request's prefix keys (``contracts.prefix_keys``), the keys each engine reported
matching, its session's hash and its balance threshold; written when a request waits, read
when it is granted. Granting a routed request records its first and deepest keys and its session.
Requests that wait for the full engines holding their prefixes (``admission/lua/cache_wait.py``)
wait until an engine's room has gone unused for their wait: ``route_waits``'s ``=room`` holds
since when a dispatch step left room unused (no request behind a waiting head could take it),
until a step ends with no room left or nobody waiting.
(9) preemption for a tenant under its share (the gateway's ``admission/lua/preempt.py`` and
``admission/preempt_share.py``): kept with the leases, at grant, release and expiry.
STATE is ``STATE_TTL_S`` (an hour): longer than any queue timeout or lease, renewed on every
write. Times are Redis server time (``TIME``) in microseconds, so replica clocks never matter.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

STATE_TTL_S = 3600
GRANT_SEPARATOR = "\x1f"
POOL_KEY_NAMES = (
    "queue",
    "entries",
    "seq",
    "leases",
    "lease_endpoint",
    "inflight",
    "stats",
    "deadlines",
    "replicas",
    "retries",
    "levels",
    "delays",
    "lease_slots",
    "routes",
    # Tenant preemption (the gateway's ``admission/lua/preempt.py``): held slots per tenant.
    "entry_tenants",
    "lease_tenants",
    "tenant_held",
    "tenant_held_at",
    "tenant_weights",
    # Prefix-aware routing: since when a waiting request waits for its engine.
    "route_waits",
)

TENANT_KEY_NAMES = ("rpm", "tpm", "inflight")


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix."""

    prefix: str = "slotserve"

    def pool(self, pool_name: str) -> list[str]:
        """The pool's keys in the order the Lua scripts expect them (KEYS[1..20])."""
        return [self.pool_key(pool_name, name) for name in POOL_KEY_NAMES]

    def pool_key(self, pool_name: str, name: str) -> str:
        """One of the pool's keys, by its name in ``POOL_KEY_NAMES``."""
        return f"{self.prefix}:{{{pool_name}}}:{name}"

    def window(self, pool_name: str, number: int) -> str:
        """The pool's admission counts of window ``number`` (``slotserve.admission_stats``)."""
        return self.pool_key(pool_name, f"window:{number}")

    def waiting(self, pool_name: str, replica_id: str) -> str:
        return self.pool_key(pool_name, f"waiting:{replica_id}")

    def fair(self, pool_name: str, level: int | str) -> str:
        return self.pool_key(pool_name, f"fair:{level}")

    def fair_queue(self, pool_name: str, level: int | str) -> str:
        return self.pool_key(pool_name, f"fairq:{level}")

    def routed(self, pool_name: str, prefix_key: str) -> str:
        return self.pool_key(pool_name, f"routed:{prefix_key}")

    def session(self, pool_name: str, session_id: str) -> str:
        return self.pool_key(pool_name, f"session:{session_id}")

    def row_claims(self, pool_name: str, url: str) -> str:
        """Grants that took a row at engine ``url`` lately (routing.ROW_CLAIM_TTL_MS)."""
        return self.pool_key(pool_name, f"row_claims:{url}")

    def tenant(self, tenant_name: str) -> list[str]:
        """The tenant's quota keys in the order the quota scripts expect them (KEYS[1..3])."""
        return [f"{self.prefix}:tenant:{tenant_name}:{name}" for name in TENANT_KEY_NAMES]

    def epoch(self) -> str:
        return f"{self.prefix}:epoch"

    def replica(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{replica_id}"

    def grants(self, replica_id: str) -> str:
        return f"{self.prefix}:grants:{replica_id}"


# Marks a Lua expression inside a key that ``Keys`` builds while the scripts' source is put
# together (never at run time); the literal parts of key names never hold it.
_LUA_MARK = "\x00"


def lua_expr(expression: str) -> str:
    """A key part that :func:`lua_key` writes as the Lua ``expression`` itself, not as text."""
    return f"{_LUA_MARK}{expression}{_LUA_MARK}"


def lua_key(key: str) -> str:
    """The Lua that builds ``key``, a ``Keys`` name whose variable parts are :func:`lua_expr`:
    ``lua_key(Keys(lua_expr("PREFIX")).replica(lua_expr("id")))`` is
    ``PREFIX .. ':replica:' .. id``. So the scripts spell no key by hand."""
    parts = key.split(_LUA_MARK)
    if len(parts) % 2 == 0:
        raise ValueError(f"an unclosed Lua expression in key {key!r}")
    pieces = []
    for index, part in enumerate(parts):
        if index % 2:
            pieces.append(part)
        elif part:
            pieces.append("'" + part.replace("\\", "\\\\").replace("'", "\\'") + "'")
    return " .. ".join(pieces)


def lua_key_locals(names: tuple[str, ...]) -> str:
    """``local K_<NAME> = KEYS[n]``, one local per name, in KEYS order: ``POOL_KEY_NAMES``
    for the admission scripts, ``TENANT_KEY_NAMES`` for the quota ones."""
    return "".join(
        f"local K_{name.upper()} = KEYS[{number}]\n" for number, name in enumerate(names, start=1)
    )


class ScriptArgs:
    """A script's arguments as a frozen dataclass whose field order is the ARGV order.

    :meth:`argv` builds them (a bool as 1/0: Redis takes no bools; a tuple, only as the last
    field, spread to the end of ARGV) and :meth:`lua_args` binds each to a Lua local, so
    neither side counts positions by hand.
    """

    __dataclass_fields__: ClassVar[dict[str, Any]]  # what makes ``fields`` take a subclass

    def argv(self) -> list[str | int]:
        out: list[str | int] = []
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, tuple):
                out.extend(value)
            else:
                out.append(int(value) if isinstance(value, bool) else value)
        return out

    @classmethod
    def lua_args(cls, first: int | str) -> str:
        """``local ARG_<FIELD> = ARGV[first + k]``: each argument's text as passed, for the
        script to check before it uses it. A tuple (last) field binds ``ARG_<FIELD>_AT``
        instead, the ARGV index it starts at (it runs to ``#ARGV``)."""
        lines = []
        for offset, field in enumerate(fields(cls)):
            if isinstance(first, int):
                index = str(first + offset)
            else:
                index = f"{first} + {offset}" if offset else first
            if str(field.type).startswith("tuple"):
                lines.append(f"local ARG_{field.name.upper()}_AT = {index}\n")
            else:
                lines.append(f"local ARG_{field.name.upper()} = ARGV[{index}]\n")
        return "".join(lines)


# The values of one offer in a dispatching script's ARGV: url, slots_total, load_score, rows_free.
OFFER_ARGS = 6


@dataclass(frozen=True)
class DispatchArgs(ScriptArgs):
    """The first arguments of every dispatching script (the gateway's
    ``admission/lua/scripts.py``), in ARGV order.

    :meth:`argv` builds them and :meth:`lua_locals` binds each to a Lua local named after its
    field in capitals (numbers through ``tonumber``), so neither side counts positions by
    hand. ``num_offers`` offers of ``OFFER_ARGS`` values (url, slots_total, load_score,
    rows_free, row_idle_ms, report_age_ms) follow, then each script's own arguments.
    """

    prefix: str
    pool: str
    caller: str  # the calling replica
    lease_ttl_us: int
    state_ttl_ms: int
    known_epoch: str  # the admission epoch the caller knows ("" if none yet)
    sweep_batch: int
    max_queue: int  # the pool's maxQueueSize
    preempt: bool  # the pool's preemptForShare: a tenant under its share may preempt
    num_offers: int

    @classmethod
    def lua_locals(cls) -> str:
        """``local PREFIX = ARGV[1]`` ..., numbers through ``tonumber``."""
        lines = []
        for number, field in enumerate(fields(cls), start=1):
            value = f"ARGV[{number}]" if field.type == "str" else f"tonumber(ARGV[{number}])"
            lines.append(f"local {field.name.upper()} = {value}\n")
        return "".join(lines)

    @classmethod
    def first_offer_index(cls) -> int:
        """The ARGV index of the first offer's url (Lua counts from 1)."""
        return len(fields(cls)) + 1
