"""Heartbeats are best-effort: a beat that cannot be published is skipped, never raised."""

from __future__ import annotations

import asyncio

import pytest

from rlbus.bus.protocol import BusClosed, PublishTimeout
from rlbus.bus.subjects import Subjects
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle

pytestmark = pytest.mark.asyncio


class FlakyBus:
    """Publishes fail while ``away`` (as during a server outage), hang when ``hang``."""

    def __init__(self) -> None:
        self.away = True
        self.hang = False
        self.published: list[str] = []
        self.failed = 0

    async def publish(self, subject: str, data: bytes, *, msg_id: str, headers: dict[str, str] | None = None) -> None:
        if self.hang:
            await asyncio.Event().wait()
        if self.away:
            self.failed += 1
            raise PublishTimeout("publish to the metrics subject was not acknowledged within 2s")
        self.published.append(msg_id)


async def test_the_heartbeat_loop_skips_missed_beats_and_goes_on():
    bus = FlakyBus()
    beat = Beat(bus, Subjects("hb"), "reward", "0", period=0.01, send_timeout=5.0)  # type: ignore[arg-type]
    life = Lifecycle()
    loop = asyncio.create_task(beat.loop(life))
    async with asyncio.timeout(10):
        while bus.failed < 5:
            await asyncio.sleep(0.01)
        assert not loop.done(), "a failed heartbeat publish ended the heartbeat loop"
        bus.away = False  # the server is back
        while len(bus.published) < 3:
            await asyncio.sleep(0.01)
    life.shutdown()
    await asyncio.wait_for(loop, 5)
    assert beat.missed >= 5 and beat.state == "stopped"


async def test_a_hanging_beat_is_bounded_by_its_send_timeout():
    bus = FlakyBus()
    bus.hang = True
    beat = Beat(bus, Subjects("hb"), "reward", "0", send_timeout=0.05)  # type: ignore[arg-type]
    async with asyncio.timeout(5):
        assert await beat.send() is False
    assert beat.missed == 1


async def test_a_closed_bus_still_ends_the_loop():
    class ClosedBus:
        async def publish(self, *a: object, **kw: object) -> None:
            raise BusClosed("bus 'x' is closed")

    beat = Beat(ClosedBus(), Subjects("hb"), "reward", "0")  # type: ignore[arg-type]
    with pytest.raises(BusClosed):
        await beat.send()


async def test_a_beat_the_schema_refuses_is_skipped_and_the_next_one_goes_out():
    bus = FlakyBus()
    bus.away = False
    broken = True

    def extra() -> dict[str, float]:
        return {"x" * 10_000: 1.0} if broken else {"ok": 1.0}  # a metric name no schema accepts

    beat = Beat(bus, Subjects("hb"), "controller", "0", period=0.01, send_timeout=5.0)  # type: ignore[arg-type]
    beat.extra = extra
    assert await beat.send() is False and beat.missed == 1
    broken = False
    assert await beat.send() is True and len(bus.published) == 1


async def test_soon_sends_the_next_beat_without_waiting_out_the_period():
    """A generator's new weights version opens the controller's admission window: its beat goes out
    at once, not up to a period later (with a 60 s period only ``soon`` can send the second beat)."""
    bus = FlakyBus()
    bus.away = False
    beat = Beat(bus, Subjects("hb"), "generator", "0", period=60.0)  # type: ignore[arg-type]
    life = Lifecycle()
    loop = asyncio.create_task(beat.loop(life))
    async with asyncio.timeout(10):
        while not bus.published:
            await asyncio.sleep(0.01)
        beat.soon()
        while len(bus.published) < 2:
            await asyncio.sleep(0.01)
    life.shutdown()
    await asyncio.wait_for(loop, 5)
    assert len(bus.published) == 3 and beat.state == "stopped"  # the first, the one asked for, the last
