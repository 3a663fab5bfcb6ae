"""Tenant preemption (issue 26): a request the gateway sent over an engine's slots takes a slot.

The gateway grants a request of a tenant under its weighted share of the pool (or of a light
tenant at it) a slot on an engine that is full, marked with the tenant to take it from
(``x-slotserve-preempt``, ``SamplingParams.preempt_tenant``); at most half the engine's slots of
such requests at a time. The engine makes room at the next step by preempting one running
sequence per waiting preemptor, as vLLM's scheduler preempts by recompute when its KV
blocks run out: the victim loses its KV (its row may survive in the prefix cache, so its
recompute is then a copy) and goes back to the front of the waiting queue, so it resumes first
when a slot frees. Its tokens, generator and penalty counts stay on the sequence, so its answer
is the same as without the preemption; its stream only pauses.

Pure functions over sequences; the scheduler calls them (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.sequence import Sequence

SALT_SEPARATOR = "\x1f"  # between the gateway's salt (the tenant) and a client's own


def tenant_of(params: SamplingParams) -> str:
    """The tenant a sequence runs for: the gateway's part of its cache salt ('' without one)."""
    salt = params.cache_salt or ""
    return salt.split(SALT_SEPARATOR, 1)[0]


def is_preemptor(seq: Sequence) -> bool:
    """A sequence that may take a running one's slot: it carries a victim tenant and has never
    run (a preemptor itself preempted for KV later waits like anyone)."""
    return seq.params.preempt_tenant is not None and seq.first_scheduled_time is None


def pick_victim(running: Seq[Sequence], preemptor: Sequence) -> Sequence | None:
    """The newest running sequence of the named victim tenant, else the newest of any tenant
    but the preemptor's own (the gateway's counts may be a step behind the engine's); None when
    every running sequence is the preemptor's tenant's."""
    wanted, own = preemptor.params.preempt_tenant, tenant_of(preemptor.params)
    others = [seq for seq in running if tenant_of(seq.params) != own]
    named = [seq for seq in others if tenant_of(seq.params) == wanted]
    pool = named or others
    return pool[-1] if pool else None
