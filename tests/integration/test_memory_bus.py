"""MemoryBus: the same outcome semantics as the real bus, in-process, for handler tests."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from bus.memory import MemoryBus
from bus.protocol import BusConfigError, ConsumerSpec, Delivery, DigestMismatch, Poison, RequestFailed, Retry
from schemas import Task

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


async def test_dedupe_and_work_queue_removal():
    bus = MemoryBus("m")
    s = bus.subjects
    await bus.publish(s.tasks("math"), _task(1), msg_id="a")
    await bus.publish(s.tasks("math"), _task(1), msg_id="a")
    assert len(bus.messages("TASKS")) == 1
    seen = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        seen.append(task.task_id)

    async with _consuming(bus, _spec(bus), handler):
        await _until(lambda: seen)
    assert seen == ["t1"] and bus.messages("TASKS") == []


async def test_outcomes_retry_poison_schema_error_and_max_deliveries():
    bus = MemoryBus("m")
    s = bus.subjects
    await bus.publish(s.tasks("math"), b"junk", msg_id="bad")
    for i in range(1, 4):
        await bus.publish(s.tasks("math"), _task(i), msg_id=f"t{i}")
    calls: list[tuple[str, int]] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        calls.append((task.task_id, d.deliveries))
        if task.task_id == "t1" and d.deliveries == 1:
            raise Retry("later", delay=0.05)
        if task.task_id == "t2":
            raise Poison("no such dataset")
        if task.task_id == "t3":
            raise RuntimeError("boom")

    async with _consuming(bus, _spec(bus, max_deliver=2), handler):
        await _until(lambda: len(bus.dead_letters) == 3)
        await _until(lambda: ("t1", 2) in calls)
    by_reason = {dl.reason: dl for dl in bus.dead_letters}
    assert "SchemaError" in by_reason["schema_error"].error and by_reason["schema_error"].data == b"junk"
    assert by_reason["no such dataset"].data == _task(2)
    assert by_reason["max_deliveries"].deliveries == 2 and "boom" in by_reason["max_deliveries"].error
    assert ("t3", 1) in calls and ("t3", 2) in calls and ("t3", 3) not in calls
    await _until(lambda: bus.messages("TASKS") == [])


async def test_puller_settles_later_and_overlapping_durables_are_refused():
    bus = MemoryBus("m")
    s = bus.subjects
    await bus.publish(s.tasks("math"), _task(1), msg_id="a")
    p = bus.puller(_spec(bus), Task.decode)
    (d,) = await p.fetch(5, timeout=0.1)
    assert await p.fetch(5, timeout=0.05) == []  # in flight until settled (no ack_wait here)
    await d.nak()
    (again,) = await p.fetch(5, timeout=0.1)
    assert again.deliveries == 2
    await again.ack()
    assert await p.pending() == 0
    with pytest.raises(BusConfigError):
        bus.puller(ConsumerSpec(stream="TASKS", durable="all", filter_subjects=(s.all_of("tasks"),)), Task.decode)


async def test_request_serve_watch_last_and_objects():
    bus = MemoryBus("m")
    s = bus.subjects

    async def echo(data: bytes) -> bytes:
        if data == b"bad":
            raise ValueError("nope")
        return data[::-1]

    await bus.serve(s.env_any("reset"), echo, queue="environment")
    assert await bus.request(s.env("addition", "reset"), b"abc", timeout=1) == b"cba"
    with pytest.raises(RequestFailed, match="nope"):
        await bus.request(s.env("addition", "reset"), b"bad", timeout=1)
    with pytest.raises(RequestFailed, match="no responders"):
        await bus.request(s.env("addition", "step"), b"", timeout=1)

    await bus.publish(s.weights("policy"), b"v1", msg_id="w1")
    w = bus.watch(s.weights("policy"), deliver="last_per_subject")
    await bus.publish(s.weights("policy"), b"v2", msg_id="w2")
    assert [(await w.__anext__()).msg for _ in range(2)] == [b"v1", b"v2"]
    assert await bus.last(s.weights("policy")) == b"v2"
    assert await bus.last(s.weights("none")) is None

    info = await bus.objects.put("w/1", b"bytes")
    assert await bus.objects.get("w/1") == b"bytes" and info.size == 5
    bus.objects.corrupt("w/1", b"BYTES")
    with pytest.raises(DigestMismatch):
        await bus.objects.get("w/1")
    await bus.close()
    await bus.close()
