"""A run on a 3-node JetStream cluster on loopback, with ``[run] replicas = 3``.

- Six services connecting together to a fresh cluster, whose nodes are still coming up, all
  declare the run's streams (JetStream drops or refuses API requests while it elects its meta
  leader and while too few nodes have joined to place three replicas; ``rlbus.bus.streams``).
- The TASKS stream's leader is killed (SIGKILL, by its pid) while a producer publishes and a
  consumer takes tasks through the bus's own pull/ack path: every task is acked, none twice; the
  pause the failover caused is printed and recorded as a test property, not asserted.  Each
  task's result is stored exactly once (by its msg id); a task whose ack died with the leader is
  delivered and acked again (at-least-once), counted as ``acked_twice``.
- Three replicas asked of a single server: refused at once, naming the key.
- A run whose streams were made with one replica is raised to three in place by reconnecting
  with ``replicas = 3``: messages, durables and the object bucket stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rlbus.bus.jetstream import JetStreamBus
from rlbus.bus.protocol import BusConfigError, Delivery
from rlbus.bus.retention import Retention
from rlbus.bus.server import EmbeddedServer, cluster_nodes
from rlbus.bus.subjects import STREAM_KINDS
from rlbus.schemas import Task
from tests.integration.helpers import eventually, task_spec

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

R3 = Retention(replicas=3)


@contextlib.asynccontextmanager
async def cluster(root: Path) -> AsyncIterator[list[EmbeddedServer]]:
    """Three clustered nodes, started together and stopped after."""
    nodes = cluster_nodes(3, root)
    try:
        await asyncio.gather(*(n.astart() for n in nodes))
        yield nodes
    finally:
        await asyncio.gather(*(asyncio.to_thread(n.cleanup) for n in nodes))


async def _start_later(node: EmbeddedServer, delay: float) -> None:
    await asyncio.sleep(delay)
    await node.astart()


def urls(nodes: list[EmbeddedServer]) -> str:
    return ",".join(n.url for n in nodes)


async def connect(nodes: list[EmbeddedServer], run: str, name: str, **options: Any) -> JetStreamBus:
    return await JetStreamBus.connect(urls(nodes), run, name=name, connect_timeout=120.0, **options)


def _task(i: int) -> Task:
    return Task(run="r", task_id=f"t{i}", pool="math", env="addition", prompt=f"{i}+1=")


async def stream_replicas(bus: JetStreamBus, name: str) -> tuple[int, str, list[str]]:
    """Declared replicas, the leader, and the peers that are current."""
    info = await bus.connection.js.stream_info(name)
    peers = [p.name for p in (info.cluster.replicas or []) if p.current] if info.cluster else []
    return info.config.num_replicas, info.cluster.leader if info.cluster else "", peers


@pytest.mark.slow
async def test_six_services_starting_with_a_fresh_cluster_all_declare_the_streams(tmp_path):
    async with contextlib.AsyncExitStack() as stack:
        # The services start while the second and third nodes are still on their way: first no
        # meta leader (requests dropped), then two nodes (no room for three replicas).
        nodes = cluster_nodes(3, tmp_path)
        stack.push_async_callback(lambda: asyncio.gather(*(asyncio.to_thread(n.cleanup) for n in nodes)))
        await nodes[0].astart()
        started: dict[str, float] = {}

        async def service(i: int) -> JetStreamBus:
            t0 = time.monotonic()
            bus = await connect(nodes, "race", f"service-{i}", retention=R3)
            started[bus.name] = round(time.monotonic() - t0, 2)
            return bus

        results = await asyncio.gather(*(service(i) for i in range(6)), _start_later(nodes[1], 0.5),
                                       _start_later(nodes[2], 4.0), return_exceptions=True)
        buses = [r for r in results[:6] if isinstance(r, JetStreamBus)]
        for b in buses:
            stack.push_async_callback(b.close)
        print(f"\nseconds to declare the streams, per service: {started}")
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} of 6 services could not start: {failed}"
        s = buses[0].subjects
        for kind in STREAM_KINDS:
            replicas, leader, _ = await stream_replicas(buses[0], s.stream(kind))
            assert replicas == 3 and leader, f"{kind}: {replicas} replicas, leader {leader!r}"
        await buses[0].objects.put("w", b"x" * 1000)
        assert (await stream_replicas(buses[0], f"OBJ_{s.object_bucket}"))[0] == 3


class Consumer:
    """A generator's shape: takes a task through a puller, publishes its result under a msg id
    derived from the task (``RolloutGroup.msg_id`` is), then acks; records each ack and when."""

    def __init__(self, bus: JetStreamBus) -> None:
        self.bus = bus
        self.puller = bus.puller(task_spec(bus, ack_wait=5.0, max_deliver=20), Task.decode)
        self.acked: list[str] = []
        self.acked_at: list[float] = []

    async def run(self, total: int) -> None:
        """Until every task is acked and TASKS is empty: an ack that died with the killed leader
        leaves its task stored, and it comes back after ack_wait to be acked again (counted)."""
        while len(set(self.acked)) < total or await self.tasks_left():
            try:
                batch: list[Delivery[Task]] = await self.puller.fetch(10, timeout=1.0)
            except Exception as exc:  # noqa: BLE001 - the failover may fail a pull; the next one goes on
                print(f"pull failed during the failover: {exc!r}")
                await asyncio.sleep(0.2)
                continue
            for d in batch:
                await self.bus.publish(self.bus.subjects.rollouts("math"), d.msg.task_id.encode(),
                                       msg_id=f"rollouts.{d.msg.task_id}")
                await d.ack()
                self.acked.append(d.msg_id)
                self.acked_at.append(time.monotonic())


    async def tasks_left(self) -> int:
        try:
            info = await self.bus.connection.js.stream_info(self.bus.subjects.stream("TASKS"))
        except Exception:  # noqa: BLE001 - mid-failover; ask again on the next turn
            return 1
        return int(info.state.messages)


def longest_gap(times: list[float], around: float) -> float:
    """The longest pause between consecutive events from just before ``around`` on."""
    after = [t for t in times if t >= around - 1.0]
    return max((b - a for a, b in zip(after, after[1:], strict=False)), default=0.0)


@pytest.mark.slow
async def test_killing_the_tasks_stream_leader_mid_run_loses_and_duplicates_nothing(tmp_path, record_property):
    total = 400
    async with cluster(tmp_path) as nodes:
        producer = await connect(nodes, "failover", "producer", retention=R3)
        consumer_bus = await connect(nodes, "failover", "consumer", retention=R3)
        try:
            s = producer.subjects
            consumer = Consumer(consumer_bus)
            published_at: list[float] = []

            async def produce() -> None:
                for i in range(total):
                    await producer.publish(s.tasks("math"), _task(i).encode(), msg_id=f"t{i}")
                    published_at.append(time.monotonic())
                    await asyncio.sleep(0.01)

            consuming = asyncio.create_task(consumer.run(total))
            producing = asyncio.create_task(produce())
            await eventually(lambda: len(consumer.acked) >= total // 4, timeout=60)
            _, leader, _ = await stream_replicas(producer, s.stream("TASKS"))
            victim = next(n for n in nodes if n.server_name == leader)
            killed_at = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)  # a node lost, not shut down: no leadership hand-over
            await asyncio.to_thread(victim.stop)
            await asyncio.wait_for(producing, timeout=120)
            await asyncio.wait_for(consuming, timeout=120)

            # Nothing lost: every task acked.  Nothing duplicated: one result per task stored.  A
            # task whose ack died with the leader comes back after ack_wait and is acked again
            # (at-least-once delivery); its second result is dropped by the msg id.  Counted.
            assert set(consumer.acked) == {f"t{i}" for i in range(total)}
            info = await producer.connection.js.stream_info(s.stream("ROLLOUTS"))
            assert info.state.messages == total, f"{info.state.messages} results stored for {total} tasks"
            left = (await producer.connection.js.stream_info(s.stream("TASKS"))).state.messages
            assert left == 0, f"{left} tasks still in TASKS after all were acked"
            _, new_leader, _ = await stream_replicas(producer, s.stream("TASKS"))
            figures = {"killed_leader": leader, "new_leader": new_leader,
                       "publish_pause_s": round(longest_gap(published_at, killed_at), 2),
                       "ack_pause_s": round(longest_gap(consumer.acked_at, killed_at), 2),
                       "acked_twice": len(consumer.acked) - total}
            print(f"\nTASKS leader killed mid-run: {figures}")
            for key, value in figures.items():
                record_property(key, value)
            assert new_leader and new_leader != leader
        finally:
            await consumer_bus.close()
            await producer.close()


@pytest.mark.slow
async def test_a_runs_streams_are_raised_from_one_replica_to_three_in_place(tmp_path):
    async with cluster(tmp_path) as nodes:
        old = await connect(nodes, "grow", "before", retention=Retention())
        s = old.subjects
        await old.publish(s.tasks("math"), _task(1).encode(), msg_id="t1")
        await old.objects.put("w", b"weights" * 100)
        puller = old.puller(task_spec(old), Task.decode)
        assert await puller.pending() == 1  # declares the durable
        assert (await stream_replicas(old, s.stream("TASKS")))[0] == 1
        await old.close()

        new = await connect(nodes, "grow", "after", retention=R3)
        try:
            await new.objects.get("w")  # the bucket is updated on first use
            for name in [s.stream(k) for k in ("TASKS", "ROLLOUTS", "SCORED", "DEAD")] + [f"OBJ_{s.object_bucket}"]:
                async def three_current(name: str = name) -> bool:
                    replicas, leader, peers = await stream_replicas(new, name)
                    return replicas == 3 and bool(leader) and len(peers) == 2
                await eventually_async(three_current, timeout=30)
            assert await new.objects.get("w") == b"weights" * 100
            # The durable made at one replica is copied too, or a node loss would take it away.
            puller = new.puller(task_spec(new), Task.decode)
            await puller.pending()  # declares (updates) the durable

            async def durable_on_three() -> bool:
                info = await new.connection.js.consumer_info(s.stream("TASKS"), task_spec(new).durable)
                return info.cluster is not None and len(info.cluster.replicas or []) == 2
            await eventually_async(durable_on_three, timeout=60)
            (d,) = await puller.fetch(1, timeout=5.0)
            assert d.msg.task_id == "t1"
            await d.ack()
        finally:
            await new.close()


async def test_three_replicas_on_a_single_server_fail_fast_naming_the_key(nats_server, run_name):
    t0 = time.monotonic()
    with pytest.raises(BusConfigError) as err:
        await JetStreamBus.connect(nats_server.url, run_name, name="r3", retention=R3, connect_timeout=120.0)
    assert time.monotonic() - t0 < 10.0  # a configuration error, not waited out like a cluster that is starting
    assert "[run] replicas = 3" in str(err.value) and "[run] replicas = 1" in str(err.value)


async def eventually_async(predicate: Any, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.2)
