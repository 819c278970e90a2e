"""What the rest of the run learns when the generator's core changes: its heartbeat and its batch loop."""

from __future__ import annotations

import asyncio

from rlbus.services.generator.core import Generator
from rlbus.services.runtime.heartbeat import Beat


class Status:
    """The heartbeat (read by the controller and ``rlbus status``) and the batch loop's wake-up.

    They are told together because whatever the controller should see (a decision applied, new
    weights) may also be what a waiting batch loop waits for (room in the grant, a fresher version)."""

    def __init__(self, beat: Beat, gen: Generator) -> None:
        self.beat = beat
        self.gen = gen
        self._changed = asyncio.Event()
        beat.extra = gen.metrics
        self.show()

    def show(self) -> None:
        """Copy the core's state into the next heartbeat (sent on the beat's period, or at once for a new version)."""
        self.beat.state = self.gen.state
        self.beat.info = self.gen.info()
        self.note_version()

    def note_version(self) -> None:
        """The controller holds admission for generators on old weights: say which version is live,
        at once when it changed (a beat period later, the freed window would wait that long).  Cheap:
        the episode loop calls it after every engine run."""
        version = self.gen.backend.version
        if version != self.beat.version:
            self.beat.version = version
            self.beat.soon()

    def set_metric(self, key: str, value: float) -> None:
        self.beat.metrics[key] = value

    def changed(self) -> None:
        """A decision was applied or weights were staged: show it, and wake a waiting batch loop."""
        self.show()
        self._changed.set()

    async def wait_for_change(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the next ``changed``; True when one came."""
        self._changed.clear()
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel on 3.11
                await self._changed.wait()
        except TimeoutError:
            return False
        return True
