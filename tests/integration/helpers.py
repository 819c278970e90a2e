"""Small helpers for the real-server bus tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from rlbus.bus.protocol import ConsumerSpec
from rlbus.schemas import DeadLetter


def task_spec(bus: Any, pool: str = "math", **kw: Any) -> ConsumerSpec:
    params: dict[str, Any] = dict(ack_wait=2.0, max_deliver=3)
    params.update(kw)
    return ConsumerSpec(stream="TASKS", durable=bus.subjects.durable("generator", pool),
                        filter_subjects=(bus.subjects.tasks(pool),), **params)


async def dead_letters(bus: Any, n: int | None, timeout: float = 10.0) -> list[DeadLetter]:
    """The first ``n`` dead letters of the run (all origins), or fail after ``timeout``.
    ``n=None``: every dead letter that arrives within ``timeout`` (the stream is replayed from its start)."""
    out: list[DeadLetter] = []
    w = bus.watch(bus.subjects.all_of("dead"), deliver="all")
    try:
        async with asyncio.timeout(timeout):
            async for d in w:
                out.append(DeadLetter.decode(d.msg))
                if n is not None and len(out) >= n:
                    break
    except TimeoutError:
        if n is not None:
            raise
    finally:
        await w.aclose()
    return out


async def stream_messages(bus: Any, kind: str) -> int:
    name = bus.subjects.stream(kind)
    return next(s.messages for s in await bus.streams() if s.name == name)


@contextlib.asynccontextmanager
async def consuming(bus: Any, spec: ConsumerSpec, decode: Callable[[bytes], Any],
                    handler: Callable[[Any, Any], Awaitable[None]], **kw: Any) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``rlbus.bus.consume`` in the background for the duration of the block, then cancel it."""
    task = asyncio.create_task(bus.consume(spec, decode, handler, **kw))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def eventually(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> None:
    async with asyncio.timeout(timeout):
        while True:
            result = predicate()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return
            await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def broadcast_running(bus: Any, run: str, run_dir: Any) -> AsyncIterator[Any]:
    """A weight-broadcast service on ``bus`` (object-store transport) running its loops until the
    block ends; yields the service (its ``b`` is the Broadcaster)."""
    from rlbus.services.broadcast.service import Broadcaster, BroadcastService
    from rlbus.services.broadcast.settings import BroadcastSettings
    from rlbus.services.runtime.config import RunSettings
    from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped
    from rlbus.services.runtime.weights import ObjectStoreTransport

    cfg = BroadcastSettings()
    life = Lifecycle(grace=2.0)
    service = BroadcastService(RunSettings(run=run, run_dir=str(run_dir)), cfg, bus=bus, life=life,
                               broadcaster=Broadcaster(ObjectStoreTransport(bus), cfg))
    task = asyncio.create_task(run_until_stopped(life, *service.workers()))
    try:
        yield service
    finally:
        life.shutdown()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
