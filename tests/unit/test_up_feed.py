"""`rlbus up`'s task feed: as the backlog drains, epoch after epoch, then a clear stop when the task
set is used up (a run must never sit forever waiting for tasks that will not come)."""

from __future__ import annotations

import asyncio

from rlbus.bus.memory import MemoryBus
from rlbus.bus.protocol import ConsumerSpec
from rlbus.bus.subjects import Subjects
from rlbus.schemas import Task
from rlbus.services.up import watch


def _tasks(n: int) -> list[Task]:
    return [Task(run="test", task_id=f"add-{i}", pool="train", env="addition", prompt=f"{i}+1=") for i in range(n)]


async def test_each_epoch_republishes_the_set_reshuffled_under_new_ids_then_says_it_is_used_up(monkeypatch):
    monkeypatch.setattr(watch, "FEED_CHUNK", 4)
    monkeypatch.setattr(watch, "FEED_DRY_S", 0.0)
    bus, subjects, tasks = MemoryBus("test"), Subjects("test"), _tasks(6)
    # A consumer that takes and acks everything, like a generator keeping up.
    puller = bus.puller(ConsumerSpec(stream="TASKS", durable=subjects.durable("generator", "train"),
                                     filter_subjects=(subjects.tasks("train"),)), Task.decode)
    taken: list[str] = []
    stop = asyncio.Event()

    async def generator() -> None:
        while not stop.is_set():
            for d in await puller.fetch(3, timeout=0.05):
                taken.append(d.msg.task_id)
                await d.ack()

    gen = asyncio.create_task(generator())
    why = await asyncio.wait_for(watch.feed(bus, subjects, tasks, stop, epochs=3, seed=0, idle_s=lambda: 1.0), 30)
    stop.set()
    await gen
    assert why is not None and "all 3 epoch(s) over the 6 training tasks used" in why
    ids = [t.task_id for t in tasks]
    assert taken[:6] == ids
    assert sorted(taken[6:12]) == sorted(f"{i}.e1" for i in ids) and taken[6:12] != [f"{i}.e1" for i in ids]
    assert sorted(taken[12:]) == sorted(f"{i}.e2" for i in ids)


async def test_unbounded_epochs_feed_until_the_run_stops(monkeypatch):
    monkeypatch.setattr(watch, "FEED_CHUNK", 4)
    bus, subjects, stop = MemoryBus("test"), Subjects("test"), asyncio.Event()
    feeding = asyncio.create_task(watch.feed(bus, subjects, _tasks(4), stop, epochs=0, seed=0, idle_s=lambda: 1e9))
    # No generator has made its consumer yet: one chunk goes out, then the feed waits for one.
    await asyncio.sleep(0.5)
    assert len(bus.messages("TASKS")) == 4
    puller = bus.puller(ConsumerSpec(stream="TASKS", durable=subjects.durable("generator", "train"),
                                     filter_subjects=(subjects.tasks("train"),)), Task.decode)
    for d in await puller.fetch(4, timeout=0.1):
        await d.ack()
    # Drained: the next chunk is the second epoch (the set has 4 tasks), and so on until stopped.
    await asyncio.sleep(1.5)
    stop.set()
    assert await asyncio.wait_for(feeding, 5) is None
    queued = [Task.decode(data).task_id for _, data in bus.messages("TASKS")]
    assert sorted(queued[:4]) == [f"add-{i}.e1" for i in range(4)], queued
