"""Periodic heartbeats: liveness, version and path-like metrics on METRICS.

Heartbeats are best-effort: each one is superseded by the next, so a beat that cannot be
published (the server is away, METRICS refuses it) is logged and skipped, never raised — a
heartbeat must not be what stops a service during a server outage.  Each send is bounded by
``send_timeout`` so a beat never waits out the bus's (long) publish outage deadline; the loop
simply tries again next period, and the first beat after the server returns reports the current
state.  Only a closed bus ends the loop.

Each heartbeat built is also handed to the process's Prometheus endpoint (``rlbus.observability.metrics``,
when ``[run] metrics_port`` serves one) before it is published: a scrape shows the same values, and
goes on showing them while the server is away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from rlbus.bus.protocol import Bus, BusClosed
from rlbus.bus.subjects import Subjects
from rlbus.observability import metrics as prometheus
from rlbus.observability.logging import get_logger
from rlbus.schemas import Heartbeat
from rlbus.services.runtime.lifecycle import Lifecycle

log = get_logger()

DEFAULT_SEND_TIMEOUT_S = 10.0


class Beat:
    """Holds the latest metrics of a service; ``loop`` publishes them every ``period`` seconds."""

    def __init__(self, bus: Bus, subjects: Subjects, service: str, instance: str, *, period: float = 1.0,
                 send_timeout: float = DEFAULT_SEND_TIMEOUT_S) -> None:
        self.bus = bus
        self.subject = subjects.metrics(service, instance)
        self.service = service
        self.instance = instance
        self.period = period
        self.send_timeout = send_timeout
        self.seq = 0
        self.state = "starting"
        self.version = -1
        self.metrics: dict[str, float] = {}
        self.info: dict[str, Any] = {}
        self.extra: Callable[[], dict[str, float]] | None = None
        self.missed = 0  # beats that could not be published (skipped)
        self._soon = asyncio.Event()

    async def send(self) -> bool:
        """Publish one heartbeat now; False (logged) if it could not be published.  Raises only
        ``BusClosed``: a closed bus is the service's end, a missed beat is not."""
        self.seq += 1
        try:  # building it too: metrics the schema refuses cost this beat, not the heartbeat loop
            metrics = dict(self.metrics)
            if self.extra is not None:
                metrics.update(self.extra())
            hb = Heartbeat(service=self.service, instance=self.instance, seq=self.seq, ts=time.time(),
                           state=self.state, version=self.version, metrics=metrics, info=self.info)
            prometheus.observe(hb)
            async with asyncio.timeout(self.send_timeout):
                await self.bus.publish(self.subject, hb.encode(), msg_id=hb.msg_id)
        except BusClosed:
            raise
        except Exception as exc:  # noqa: BLE001 - best-effort: the next beat supersedes this one
            self.missed += 1
            log.warning("heartbeat_missed", subject=self.subject, seq=self.seq, missed=self.missed,
                        error=f"{type(exc).__name__}: {exc}"[:300])
            return False
        return True

    def soon(self) -> None:
        """Send the next beat now rather than at the end of the period: for a change another service
        acts on at once (a generator's new weights version opens its admission window)."""
        self._soon.set()

    async def loop(self, life: Lifecycle) -> None:
        while not life.stopping.is_set():
            self._soon.clear()
            await self.send()
            if await self._pause(life):
                break
        self.state = "stopped"
        await self.send()

    async def _pause(self, life: Lifecycle) -> bool:
        """Wait out the period, or until ``soon``; True when the service should stop."""
        waits = {asyncio.ensure_future(life.stopping.wait()), asyncio.ensure_future(self._soon.wait())}
        try:
            await asyncio.wait(waits, timeout=self.period, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return life.stopping.is_set()
