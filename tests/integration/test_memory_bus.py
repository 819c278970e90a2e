"""What only MemoryBus has: its test helpers, its object-store hook, and where it deliberately
differs from a server (no ack_wait, no claim check).  Everything both buses promise is in
``test_bus_contract.py``, which runs against MemoryBus too."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from rlbus.bus.memory import MemoryBus
from rlbus.bus.protocol import BusConfigError, ConsumerSpec, Delivery, DigestMismatch, ObjectNotFound
from rlbus.schemas import DeadLetter, Task

pytestmark = pytest.mark.asyncio


def _task(i: int) -> bytes:
    return Task(run="r", task_id=f"t{i}", pool="math", env="addition", prompt=f"{i}+1=").encode()


def _spec(bus: MemoryBus, **kw) -> ConsumerSpec:
    return ConsumerSpec(stream="TASKS", durable="gen_math", filter_subjects=(bus.subjects.tasks("math"),), **kw)


@contextlib.asynccontextmanager
async def _consuming(bus, spec, handler):
    task = asyncio.create_task(bus.consume(spec, Task.decode, handler))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _until(pred, timeout=2.0):
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.005)


async def test_dead_letters_and_messages_helpers_and_no_backoff_by_default():
    bus = MemoryBus("m")
    s = bus.subjects
    await bus.publish(s.tasks("math"), b"junk", msg_id="bad")
    await bus.publish(s.tasks("math"), _task(3), msg_id="t3")
    calls: list[float] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        calls.append(time.monotonic())
        raise RuntimeError("boom")

    async with _consuming(bus, _spec(bus, max_deliver=3), handler):
        await _until(lambda: len(bus.dead_letters) == 2)
    assert calls[-1] - calls[0] < 0.5  # error_backoff defaults to (0, 0): handler tests do not wait
    schema, maxed = bus.dead_letters
    assert (schema.reason, schema.data) == ("schema_error", b"junk")
    assert (maxed.reason, maxed.deliveries) == ("max_deliveries", 3) and "boom" in maxed.error
    assert bus.messages("TASKS") == []
    assert [DeadLetter.decode(data).reason for _, data in bus.messages("DEAD")] == ["schema_error", "max_deliveries"]


async def test_unsettled_delivery_stays_in_flight_with_no_ack_wait():
    bus = MemoryBus("m")
    await bus.publish(bus.subjects.tasks("math"), _task(1), msg_id="a")
    p = bus.puller(_spec(bus, ack_wait=0.05), Task.decode)
    (d,) = await p.fetch(5, timeout=0.1)
    await asyncio.sleep(0.2)  # four times ack_wait: a server would have redelivered it
    assert await p.fetch(5, timeout=0.05) == []
    await d.in_progress()  # accepted, nothing to do
    await d.ack()


async def test_overlapping_durables_are_refused_when_the_puller_is_made():
    bus = MemoryBus("m")
    bus.puller(_spec(bus), Task.decode)
    with pytest.raises(BusConfigError, match="overlaps"):
        bus.puller(ConsumerSpec(stream="TASKS", durable="all", filter_subjects=(bus.subjects.all_of("tasks"),)),
                   Task.decode)
    bus.puller(_spec(bus, max_deliver=9), Task.decode)  # a tunable: updated in place, as on a server
    moved = ConsumerSpec(stream="TASKS", durable=_spec(bus).durable, filter_subjects=(bus.subjects.tasks("code"),))
    with pytest.raises(BusConfigError, match="cannot change in place"):
        bus.puller(moved, Task.decode)


async def test_large_payloads_are_stored_as_is_and_objects_verify_their_digest():
    bus = MemoryBus("m")
    big = b"x" * (3 * 1024 * 1024)  # no max_payload, no claim check here
    await bus.publish(bus.subjects.rollouts("math"), big, msg_id="big")
    assert bus.messages("ROLLOUTS") == [(bus.subjects.rollouts("math"), big)]
    assert await bus.objects.list() == []
    info = await bus.objects.put("w/1", b"bytes")
    assert await bus.objects.get("w/1") == b"bytes" and info.size == 5
    bus.objects.corrupt("w/1", b"BYTES")
    with pytest.raises(DigestMismatch):
        await bus.objects.get("w/1")
    await bus.objects.delete("w/1")
    with pytest.raises(ObjectNotFound):
        await bus.objects.get("w/1")
    await bus.close()
    await bus.close()
