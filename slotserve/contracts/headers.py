"""slotserve's own HTTP headers, between clients, the gateway and the engines."""

from __future__ import annotations

# Engine -> gateway -> client, on every engine answer and /load: the engine's free and total
# slots (total = its max_batch_size, or fewer when its KV memory holds fewer rows).
SLOTS_FREE_HEADER = "x-slotserve-slots-free"
SLOTS_TOTAL_HEADER = "x-slotserve-slots-total"
# Client -> gateway: the request's priority level (1 first .. the pool's priorityLevels) and the
# longest it may wait in the queue, in milliseconds (it can only shorten the pool's timeout).
PRIORITY_HEADER = "x-slotserve-priority"
DEADLINE_MS_HEADER = "x-slotserve-deadline-ms"
# Gateway -> client: how long the request waited for its slot, in milliseconds.
QUEUE_WAIT_MS_HEADER = "x-slotserve-queue-wait-ms"
# Gateway -> engine: the request's tenant, mixed into the engine's prefix-cache match so that one
# tenant's cached prompts never shorten another's time to first token. The gateway always sets it
# (a client's own value is never forwarded); an engine combines it with a body's ``cache_salt``.
CACHE_SALT_HEADER = "x-slotserve-cache-salt"
# Gateway -> engine, on a preempting grant only: the tenant over its share whose running answer
# this request may preempt when every slot of the engine runs (issue 26). Internal like the salt:
# the gateway drops a client's copy, so only the gateway's decision reaches an engine.
PREEMPT_HEADER = "x-slotserve-preempt"
