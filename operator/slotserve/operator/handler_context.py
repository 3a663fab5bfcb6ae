"""A kopf handler's context, kept for the operator's own tasks.

kopf posts events (``kopf.warn``, ``kopf.event``) only from a handler's context: it sets its
event queue per watched object, not for tasks the operator starts itself (the healer, the
admission monitor). The first handler that runs leaves a copy here, and those tasks run their
work in it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class HandlerContext:
    """The context of the first kopf handler that ran, in which the operator's tasks post."""

    def __init__(self) -> None:
        self._context: contextvars.Context | None = None

    def keep(self) -> None:
        """Called from a handler: remember its context (the first one is enough)."""
        if self._context is None:
            self._context = contextvars.copy_context()

    @property
    def can_post_events(self) -> bool:
        return self._context is not None

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` in a copy of the kept context; after ``can_post_events``."""
        if self._context is None:
            work.close()
            raise RuntimeError("no handler has run yet: kopf cannot post events")
        return await asyncio.create_task(work, context=self._context.copy())
