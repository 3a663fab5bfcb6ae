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
| ``P:{pool}:window:{n}`` | HASH | admitted, rejected, queue waits in window ``n`` (3) | 90 s |
| ``P:epoch`` | HASH | admission epoch: ``id``, ``created``, ``ready`` (us) (2) | STATE |
| ``P:replica:{id}`` | STRING | present while replica ``id`` heartbeats | lease TTL |
| ``P:grants:{id}`` | LIST | grants made for replica ``id`` by others (1) | lease TTL |

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
clients came back within their grace, and those that did not; halved past 64).
(6) start-time fair queuing within a level (``gateway/lua_fair.py``); both deleted when the level
has nothing waiting.
STATE is ``STATE_TTL_S`` (an hour): longer than any queue timeout or lease, renewed on every
write. Times are Redis server time (``TIME``) in microseconds, so replica clocks never matter.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
)


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix."""

    prefix: str = "slotserve"

    def pool(self, pool_name: str) -> list[str]:
        """The pool's keys in the order the Lua scripts expect them (KEYS[1..13])."""
        return [self.pool_key(pool_name, name) for name in POOL_KEY_NAMES]

    def pool_key(self, pool_name: str, name: str) -> str:
        """One of the pool's keys, by its name in ``POOL_KEY_NAMES``."""
        return f"{self.prefix}:{{{pool_name}}}:{name}"

    def window(self, pool_name: str, number: int) -> str:
        """The pool's admission counts of window ``number`` (``slotserve.admission_stats``)."""
        return self.pool_key(pool_name, f"window:{number}")

    def replica(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{replica_id}"

    def grants(self, replica_id: str) -> str:
        return f"{self.prefix}:grants:{replica_id}"


@dataclass(frozen=True)
class DispatchArgs:
    """The first arguments of every dispatching script (the gateway's
    ``admission/lua/scripts.py``), in ARGV order.

    :meth:`argv` builds them and :meth:`lua_locals` binds each to a Lua local named after its
    field in capitals, so neither side counts positions by hand. ``num_offers`` triples (url,
    slots_total, load_score) follow, then each script's own arguments.
    """

    prefix: str
    pool: str
    caller: str  # the calling replica
    lease_ttl_us: int
    state_ttl_ms: int
    known_epoch: str  # the admission epoch the caller knows ("" if none yet)
    sweep_batch: int
    max_queue: int  # the pool's maxQueueSize
    num_offers: int

    def argv(self) -> list[str | int]:
        return [getattr(self, field.name) for field in fields(self)]

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
