"""The one lifecycle every service runs under.

``run_until_stopped`` runs a service's workers (its loops) until one fails or a stop is requested
(SIGTERM/SIGINT set ``stopping``).  Either way it then winds the others down, bounded by
``grace``: ``stopping`` is set, so loops that check it end on their own (finishing or naking
in-flight work), and every worker still running is cancelled.  The first failure wins and is
re-raised after the wind-down, so a crashed worker always ends the service with an error
(non-zero exit) and a stop always ends it.  ``shutdown`` is idempotent.

Why a bounded wind-down and not a bare ``TaskGroup``: a ``TaskGroup`` waits without limit for
every cancelled worker, and on Python 3.11 a worker can swallow its cancellation: ``asyncio.
wait_for`` (nats-py's request path uses it, so every JetStream publish) returns normally when the
cancel lands in the loop turn in which its awaited future completed.  A heartbeat loop that lost
its cancel that way went on beating for as long as the process lived while the rest of the
service was gone (a zombie generator).  Here a worker that is still running after ``grace`` is
cancelled again, and one that outlives that too is logged and left behind, never waited on.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import io
import signal
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from rlbus.observability.logging import get_logger

log = get_logger()

# After the grace period, how long a worker that ignored its first cancel gets after the second.
RECANCEL_WAIT_S = 2.0


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
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGUSR1, log_where_everything_waits)
        # SIGUSR2: every thread's stack to stderr from the C level, which works when the event
        # loop itself is blocked and SIGUSR1's handler never runs.  Not while a SIGUSR1 dump is
        # being written: faulthandler walks the frames without locks and can crash the process.
        with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
            faulthandler.register(signal.SIGUSR2, all_threads=True)
        self._installed = True

    def shutdown(self) -> None:
        self.stopping.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopping; returns True when the service should stop.  Raises
        ``CancelledError`` when cancelled, even if ``stopping`` was set in the same loop turn
        (``asyncio.timeout``, not ``wait_for``: on 3.11 that one would return True and swallow
        the cancel)."""
        try:
            async with asyncio.timeout(seconds):
                await self.stopping.wait()
        except TimeoutError:
            pass
        return self.stopping.is_set()


def log_where_everything_waits() -> None:
    """``kill -USR1 <pid>``: log the stack of every asyncio task and thread, without stopping.

    For a service that is up, heartbeating and yet doing nothing: the stacks say what each loop
    is waiting on (a pull, a request, a lock), which no metric can."""
    tasks = [f"{task.get_name()}: {' <- '.join(reversed(_await_chain(task.get_coro())))}"[-2000:]
             for task in asyncio.all_tasks()]
    frames = sys._current_frames()
    threads = {t.name: "".join(traceback.format_stack(frames[t.ident], limit=8))[-2000:]
               for t in threading.enumerate() if t.ident in frames}
    log.warning("where_everything_waits", tasks=tasks, threads=threads)


def _await_chain(coro: Any) -> list[str]:
    """Where a suspended coroutine waits, outermost first: ``file:line in function`` per await
    (a task's own stack shows only its outermost frame)."""
    chain: list[str] = []
    while coro is not None and len(chain) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            chain.append(repr(coro)[:120])
            break
        code = frame.f_code
        chain.append(f"{'/'.join(code.co_filename.rsplit('/', 2)[-2:])}:{frame.f_lineno} {code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return chain


class Crew:
    """The workers of one ``run_until_stopped`` call: their tasks and the first failure among them."""

    def __init__(self, life: Lifecycle, workers: tuple[Callable[[], Awaitable[Any]], ...]) -> None:
        self.life = life
        self.workers = workers
        self.tasks: list[asyncio.Task[Any]] = []
        self.failure: BaseException | None = None

    async def run(self) -> None:
        self.tasks = [asyncio.create_task(_as_coroutine(w), name=f"worker-{i}-{getattr(w, '__qualname__', '?')}")
                      for i, w in enumerate(self.workers)]
        stop = asyncio.create_task(self.life.stopping.wait(), name="stop-watch")
        try:
            await self._until_failure_or_stop(stop)
        finally:
            # Also when run_until_stopped itself is cancelled: no worker outlives it unasked.
            stop.cancel()
            await self._wind_down()
        if self.failure is not None:
            raise self.failure

    async def _until_failure_or_stop(self, stop: asyncio.Task[Any]) -> None:
        running = set(self.tasks)
        while running:
            done, _ = await asyncio.wait(running | {stop}, return_when=asyncio.FIRST_COMPLETED)
            running -= done
            for task in done:
                if task is not stop and not task.cancelled() and task.exception() is not None:
                    self.failure = task.exception()
                    log.error("worker_failed", worker=task.get_name(), error=f"{type(self.failure).__name__}: "
                              f"{self.failure}"[:1000], todo="the service stops; its other workers are wound down")
                    return
            if stop in done:
                return

    async def _wind_down(self) -> None:
        """Stop every worker still running, bounded: ``grace`` after the first cancel, then a second
        cancel for any that swallowed the first, then give up on them (logged)."""
        self.life.stopping.set()  # loops that check it end by themselves, even one whose cancel was lost
        for attempt, wait_s in enumerate((self.life.grace, RECANCEL_WAIT_S)):
            left = [t for t in self.tasks if not t.done()]
            if not left:
                break
            for task in left:
                task.cancel()
            if attempt:
                log.warning("workers_recancelled", workers=[t.get_name() for t in left],
                            why=f"still running {self.life.grace:.1f}s after their cancel (a swallowed cancel?)")
            await asyncio.wait(left, timeout=max(wait_s, 0.01))
        left = [t for t in self.tasks if not t.done()]
        if left:
            log.error("workers_abandoned", workers=[t.get_name() for t in left],
                      todo="they ignored two cancels; the service stops without them")
        for task in self.tasks:  # retrieve outcomes so none is reported as "never retrieved"
            if task.done() and not task.cancelled() and task.exception() is not None and task.exception() is not self.failure:
                log.warning("worker_failed_while_stopping", worker=task.get_name(), error=repr(task.exception())[:500])


async def _as_coroutine(worker: Callable[[], Awaitable[Any]]) -> Any:
    return await worker()


async def run_until_stopped(life: Lifecycle, *workers: Callable[[], Awaitable[Any]]) -> None:
    """Run ``workers`` until one fails (its error is re-raised) or a stop is requested; the others
    are wound down within ``life.grace`` (see the module docstring)."""
    await Crew(life, workers).run()
