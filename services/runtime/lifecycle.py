"""The one lifecycle every service runs under.

Subtasks live in a ``TaskGroup``: the first failure wins and is re-raised after the others are
cancelled and cleaned up.  SIGTERM/SIGINT set ``stopping``; services stop pulling new work,
finish or nak in-flight work within ``grace`` seconds, then the bus is drained.  ``shutdown``
is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import Any


class Lifecycle:
    def __init__(self, *, grace: float = 10.0) -> None:
        self.stopping = asyncio.Event()
        self.grace = grace
        self._installed = False

    def install_signal_handlers(self) -> None:
        if self._installed:
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stopping.set)
        self._installed = True

    def shutdown(self) -> None:
        self.stopping.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopping; returns True when the service should stop."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        return self.stopping.is_set()


async def run_until_stopped(life: Lifecycle, *workers: Callable[[], Awaitable[Any]]) -> None:
    """Run ``workers`` until one fails or a stop is requested; cancel the rest within grace."""

    async def _watch_stop() -> None:
        await life.stopping.wait()
        raise _Stop

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_watch_stop())
            for w in workers:
                tg.create_task(w())
    except* _Stop:
        pass


class _Stop(Exception):
    """Internal: unwinds the TaskGroup when a stop is requested."""
