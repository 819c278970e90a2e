"""Delivery semantics of JetStreamBus on a real nats-server: dedupe, redelivery, outcomes, dead letters."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.protocol import ConsumerSpec, Delivery, Poison, Retry
from schemas import SchemaError, Task
from tests.integration.helpers import consuming, dead_letters, eventually, stream_messages, task_spec

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def _task(i: int, pool: str = "math") -> Task:
    return Task(run="r", task_id=f"t{i}", pool=pool, env="addition", prompt=f"{i}+1=")


async def test_publish_dedupes_by_msg_id(bus):
    s = bus.subjects
    await bus.publish(s.tasks("math"), _task(1).encode(), msg_id="task-1")
    await bus.publish(s.tasks("math"), _task(1).encode(), msg_id="task-1")  # a retry
    await bus.publish_many([(s.tasks("math"), _task(1).encode(), "task-1"),
                            (s.tasks("math"), _task(2).encode(), "task-2")])
    assert await stream_messages(bus, "TASKS") == 2


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


async def test_retry_redelivers_after_its_delay_with_deliveries_incremented(bus):
    s = bus.subjects
    await bus.publish(s.tasks("math"), _task(1).encode(), msg_id="t1")
    seen: list[tuple[int, float]] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        seen.append((d.deliveries, time.monotonic()))
        if d.deliveries == 1:
            raise Retry("environment busy", delay=0.6)

    async with consuming(bus, task_spec(bus), Task.decode, handler):
        await eventually(lambda: len(seen) >= 2)
    assert [n for n, _ in seen] == [1, 2]
    assert seen[1][1] - seen[0][1] >= 0.5
    await eventually(lambda: _empty(bus, "TASKS"))


async def _empty(bus, kind: str) -> bool:
    return await stream_messages(bus, kind) == 0


async def test_poison_dead_letters_reason_and_original_bytes(bus):
    s = bus.subjects
    raw = _task(7).encode()
    await bus.publish(s.tasks("math"), raw, msg_id="t7")

    async def handler(task: Task, d: Delivery[Task]) -> None:
        raise Poison("prompt references a deleted dataset")

    async with consuming(bus, task_spec(bus), Task.decode, handler):
        (dl,) = await dead_letters(bus, 1)
    assert dl.reason == "prompt references a deleted dataset"
    assert dl.data == raw
    assert dl.origin_subject == s.tasks("math")
    assert dl.headers.get("Nats-Msg-Id") == "t7"
    await eventually(lambda: _empty(bus, "TASKS"))


async def test_always_failing_handler_is_dead_lettered_via_max_deliveries_advisory(bus):
    s = bus.subjects
    raw = _task(3).encode()
    await bus.publish(s.tasks("math"), raw, msg_id="t3")
    calls: list[int] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        calls.append(d.deliveries)
        raise RuntimeError("verifier crashed")

    async with consuming(bus, task_spec(bus, max_deliver=3), Task.decode, handler):
        (dl,) = await dead_letters(bus, 1, timeout=15)
        await eventually(lambda: _empty(bus, "TASKS"))  # deleted from the work queue, not stuck
    assert calls == [1, 2, 3]
    assert dl.reason == "max_deliveries"
    assert "verifier crashed" in dl.error
    assert dl.deliveries == 3
    assert dl.data == raw


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


async def test_malformed_payload_is_dead_lettered_and_the_consumer_keeps_going(bus):
    s = bus.subjects
    await bus.publish(s.tasks("math"), b"\xc1 definitely not msgpack", msg_id="bad")
    await bus.publish(s.tasks("math"), _task(2).encode(), msg_id="good")
    handled: list[str] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        handled.append(task.task_id)

    async with consuming(bus, task_spec(bus), Task.decode, handler):
        await eventually(lambda: handled == ["t2"])
        (dl,) = await dead_letters(bus, 1)
    assert dl.reason == "schema_error"
    assert "SchemaError" in dl.error and "not valid msgpack" in dl.error
    assert dl.data == b"\xc1 definitely not msgpack"
    with pytest.raises(SchemaError):
        Task.decode(dl.data)


async def test_puller_dead_letters_bad_messages_and_returns_good_ones(bus):
    s = bus.subjects
    await bus.publish(s.tasks("math"), b"junk", msg_id="bad")
    await bus.publish(s.tasks("math"), _task(5).encode(), msg_id="t5")
    puller = bus.puller(task_spec(bus), Task.decode)
    got = []
    async with asyncio.timeout(5):
        while not got:
            got = await puller.fetch(10, timeout=0.5)
    assert [d.msg.task_id for d in got] == ["t5"]
    assert await puller.pending() == 0
    await got[0].ack()
    (dl,) = await dead_letters(bus, 1)
    assert dl.reason == "schema_error" and dl.data == b"junk"
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


async def test_work_queue_durables_of_two_pools_split_the_stream(bus):
    s = bus.subjects
    await bus.publish(s.tasks("math"), _task(1, "math").encode(), msg_id="m")
    await bus.publish(s.tasks("code"), _task(2, "code").encode(), msg_id="c")
    math = await bus.puller(task_spec(bus, "math"), Task.decode).fetch(5, timeout=1.0)
    code = await bus.puller(task_spec(bus, "code"), Task.decode).fetch(5, timeout=1.0)
    assert [d.msg.pool for d in math] == ["math"] and [d.msg.pool for d in code] == ["code"]


async def test_scored_stream_keeps_messages_after_ack_for_replay(bus):
    s = bus.subjects
    await bus.publish(s.scored("math"), b"x", msg_id="sc1")
    spec = ConsumerSpec(stream="SCORED", durable="trainer", filter_subjects=(s.all_of("scored"),))
    (d,) = await bus.puller(spec, bytes).fetch(1, timeout=2.0)
    await d.ack()
    await asyncio.sleep(0.1)
    assert await stream_messages(bus, "SCORED") == 1
