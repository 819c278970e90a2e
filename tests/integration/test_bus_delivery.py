"""Delivery semantics only a real nats-server shows: ack_wait redelivery, heartbeats that prevent it
(running handlers, the consume loop's local buffer, deliveries a puller's caller holds), the
max-deliveries advisory after ack_wait expiries, concurrent consume and its graceful stop.
The outcome rules both buses share are in ``test_bus_contract.py``."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from rlbus.bus.protocol import Delivery
from rlbus.schemas import Task
from tests.integration.helpers import consuming, dead_letters, eventually, stream_messages, task_spec

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def _task(i: int, pool: str = "math") -> Task:
    return Task(run="r", task_id=f"t{i}", pool=pool, env="addition", prompt=f"{i}+1=")


async def test_unsettled_delivery_comes_back_after_ack_wait(bus):
    s = bus.subjects
    await bus.publish(s.tasks("math"), _task(1).encode(), msg_id="t1")
    puller = bus.puller(task_spec(bus, ack_wait=1.0), Task.decode, heartbeat=False)
    first = await puller.fetch(1, timeout=2.0)
    assert [d.msg.task_id for d in first] == ["t1"] and first[0].deliveries == 1
    assert await puller.fetch(1, timeout=0.3) == []  # in flight: not handed out twice
    t0 = time.monotonic()
    again = await puller.fetch(1, timeout=3.0)  # never settled -> redelivered after ack_wait
    assert [d.msg.task_id for d in again] == ["t1"]
    assert again[0].deliveries == 2
    assert time.monotonic() - t0 >= 0.5
    await again[0].ack()


async def test_long_handler_is_kept_alive_by_heartbeats(bus):
    s = bus.subjects
    await bus.publish(s.tasks("math"), _task(1).encode(), msg_id="t1")
    calls: list[int] = []

    async def slow(task: Task, d: Delivery[Task]) -> None:
        calls.append(d.deliveries)
        await asyncio.sleep(2.5)  # 2.5 x ack_wait: only in_progress heartbeats keep it ours

    async with consuming(bus, task_spec(bus, ack_wait=1.0), Task.decode, slow):
        await eventually(lambda: calls, timeout=5)
        await asyncio.sleep(3.0)
    assert calls == [1]
    assert await stream_messages(bus, "TASKS") == 0


async def _empty(bus, kind: str) -> bool:
    return await stream_messages(bus, kind) == 0


async def test_ack_wait_expiry_also_reaches_max_deliveries(bus):
    """A consumer that dies mid-message (never settles) must not leave the task stuck forever."""
    s = bus.subjects
    raw = _task(4).encode()
    await bus.publish(s.tasks("math"), raw, msg_id="t4")
    puller = bus.puller(task_spec(bus, ack_wait=0.5, max_deliver=2), Task.decode, heartbeat=False)
    held = []
    for _ in range(2):
        held += await puller.fetch(1, timeout=3.0)
    assert [d.deliveries for d in held] == [1, 2]
    # The server notices the exhausted message when a pull is waiting (a replacement consumer).
    assert await puller.fetch(1, timeout=1.5) == []
    (dl,) = await dead_letters(bus, 1, timeout=10)
    assert dl.reason == "max_deliveries" and dl.data == raw
    await eventually(lambda: _empty(bus, "TASKS"))


async def test_concurrent_consume_handles_everything_once_and_stops_cleanly(bus):
    s = bus.subjects
    await bus.publish_many([(s.tasks("math"), _task(i).encode(), f"t{i}") for i in range(40)])
    seen: list[str] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        await asyncio.sleep(0.01)
        seen.append(task.task_id)

    async with consuming(bus, task_spec(bus), Task.decode, handler, batch=8, concurrency=4):
        await eventually(lambda: len(seen) >= 40)
    assert sorted(seen) == sorted(f"t{i}" for i in range(40))
    await eventually(lambda: _empty(bus, "TASKS"))


async def test_cancelled_consumer_hands_unstarted_work_back(bus):
    s = bus.subjects
    await bus.publish_many([(s.tasks("math"), _task(i).encode(), f"t{i}") for i in range(5)])
    started: list[str] = []

    async def stuck(task: Task, d: Delivery[Task]) -> None:
        started.append(task.task_id)
        await asyncio.sleep(60)

    spec = task_spec(bus, ack_wait=30.0)
    async with consuming(bus, spec, Task.decode, stuck, batch=5, concurrency=1):
        await eventually(lambda: started)
    # The stuck handler was naked after the grace, the buffered ones at once: a new consumer
    # gets all five now, long before the 30 s ack_wait.
    puller = bus.puller(spec, Task.decode)
    got: list[Delivery[Task]] = []
    async with asyncio.timeout(5):
        while len(got) < 5:
            got += await puller.fetch(5, timeout=0.5)
    assert sorted(d.msg.task_id for d in got) == [f"t{i}" for i in range(5)]
    for d in got:
        await d.ack()


async def test_buffered_messages_are_kept_alive_while_waiting_for_a_worker(bus):
    s = bus.subjects
    await bus.publish_many([(s.tasks("math"), _task(i).encode(), f"t{i}") for i in range(4)])
    seen: list[tuple[str, int]] = []

    async def slow(task: Task, d: Delivery[Task]) -> None:
        seen.append((task.task_id, d.deliveries))
        await asyncio.sleep(0.7)

    # All four are pulled at once; the last waits ~2.1 s (2 x ack_wait) in the local buffer.
    async with consuming(bus, task_spec(bus, ack_wait=1.0), Task.decode, slow, batch=4, concurrency=1):
        await eventually(lambda: len(seen) >= 4, timeout=10)
        await eventually(lambda: _empty(bus, "TASKS"))
    assert sorted(seen) == [(f"t{i}", 1) for i in range(4)]


async def test_puller_heartbeats_what_its_caller_holds_until_it_is_settled(bus):
    s = bus.subjects
    await bus.publish(s.tasks("math"), _task(1).encode(), msg_id="t1")
    spec = task_spec(bus, ack_wait=1.0)
    holder = bus.puller(spec, Task.decode)
    (held,) = await holder.fetch(1, timeout=2.0)
    # 2.5 x ack_wait: only the puller's heartbeat keeps it from another replica.
    other = bus.puller(spec, Task.decode, heartbeat=False)
    assert await other.fetch(1, timeout=2.5) == []
    await held.ack()
    await eventually(lambda: _empty(bus, "TASKS"))


async def test_puller_forgets_a_delivery_its_caller_dropped_unsettled(bus):
    s = bus.subjects
    await bus.publish(s.tasks("math"), _task(1).encode(), msg_id="t1")
    puller = bus.puller(task_spec(bus, ack_wait=1.0), Task.decode)
    got = await puller.fetch(1, timeout=2.0)
    assert [d.deliveries for d in got] == [1]
    del got
    gc.collect()
    again = await puller.fetch(1, timeout=3.0)  # no heartbeat for it any more: back after ack_wait
    assert [(d.msg.task_id, d.deliveries) for d in again] == [("t1", 2)]
    await again[0].ack()
