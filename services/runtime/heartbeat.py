"""Periodic heartbeats: liveness, version and path-like metrics on METRICS."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bus.protocol import Bus
from bus.subjects import Subjects
from schemas import Heartbeat
from services.runtime.lifecycle import Lifecycle


class Beat:
    """Holds the latest metrics of a service; ``loop`` publishes them every ``period`` seconds."""

    def __init__(self, bus: Bus, subjects: Subjects, service: str, instance: str, *, period: float = 1.0) -> None:
        self.bus = bus
        self.subject = subjects.metrics(service, instance)
        self.service = service
        self.instance = instance
        self.period = period
        self.seq = 0
        self.state = "starting"
        self.version = -1
        self.metrics: dict[str, float] = {}
        self.info: dict[str, Any] = {}
        self.extra: Callable[[], dict[str, float]] | None = None

    async def send(self) -> None:
        self.seq += 1
        metrics = dict(self.metrics)
        if self.extra is not None:
            metrics.update(self.extra())
        hb = Heartbeat(service=self.service, instance=self.instance, seq=self.seq, ts=time.time(),
                       state=self.state, version=self.version, metrics=metrics, info=self.info)
        await self.bus.publish(self.subject, hb.encode(), msg_id=hb.msg_id)

    async def loop(self, life: Lifecycle) -> None:
        while not life.stopping.is_set():
            await self.send()
            if await life.sleep(self.period):
                break
        self.state = "stopped"
        await self.send()
