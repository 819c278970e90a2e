"""A service object's loops running inside a test, stopped gracefully when the block ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped


@contextlib.asynccontextmanager
async def workers_running(life: Lifecycle, service: Any, *, timeout: float = 30.0) -> AsyncIterator[Any]:
    """Run ``service.workers()`` under ``life`` until the block ends, then shut down and wait up to
    ``timeout`` seconds for them (what they raised is raised here); yields ``service``."""
    task = asyncio.create_task(run_until_stopped(life, *service.workers()))
    try:
        yield service
    finally:
        life.shutdown()
        await asyncio.wait_for(task, timeout)
