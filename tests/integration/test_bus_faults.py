"""Faults the bus must survive with nothing lost or handled twice: a server outage far longer than
the publish deadline, a dead letter that cannot be written, and a max-deliveries advisory emitted
while no consumer is connected.  Each runs on a real nats-server; outages on one of the test's own
(file storage in a tmp dir, stopped and restarted by pid on the same port and store)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest

from rlbus.bus.protocol import ConsumerSpec, Delivery, ServerUnavailable
from rlbus.bus.server import EmbeddedServer
from rlbus.bus.streams import declarations, ensure_streams
from rlbus.schemas import Task
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle
from tests.conftest import BUS_TEST_OPTIONS
from tests.integration.helpers import dead_letters, eventually, task_spec

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

DEADLINE_S = 2.0  # the publish deadline under test: the outage lasts several times it
OUTAGE_S = 4 * DEADLINE_S


class Pipeline:
    """A publisher, a consume loop, a puller loop, a watch and a heartbeat on one run."""

    def __init__(self, producer: Any, consumer: Any, n: int) -> None:
        self.producer, self.consumer, self.n = producer, consumer, n
        self.s = producer.subjects
        self.published = 0
        self.handled: Counter[bytes] = Counter()
        self.pulled: Counter[bytes] = Counter()
        self.watched: list[bytes] = []
        self.life = Lifecycle()
        self.beat = Beat(producer, self.s, "generator", "0", period=0.2, send_timeout=1.0)

    async def publish_all(self) -> None:
        for i in range(self.n):  # one by one, as a generator publishes rollouts: on through the outage
            await self.producer.publish(self.s.tasks("math"), b"t%d" % i, msg_id=f"t{i}")
            await self.producer.publish(self.s.scored("math"), b"s%d" % i, msg_id=f"s{i}")
            self.published += 1
            await asyncio.sleep(0.1)
        await self.life.stopping.wait()

    async def consume(self) -> None:
        async def handler(data: bytes, d: Delivery[bytes]) -> None:
            self.handled[data] += 1

        await self.consumer.consume(task_spec(self.consumer, ack_wait=60.0, max_deliver=5), bytes, handler)

    async def pull(self) -> None:
        spec = ConsumerSpec(stream="SCORED", durable="trainer", filter_subjects=(self.s.all_of("scored"),),
                            ack_wait=60.0)
        puller = self.consumer.puller(spec, bytes)
        while True:
            for d in await puller.fetch(8, timeout=0.5):
                self.pulled[d.msg] += 1
                await d.ack()

    async def watch(self) -> None:
        async for d in self.consumer.watch(self.s.control("generator", "0"), deliver="all"):
            self.watched.append(d.msg)

    def start(self) -> list[asyncio.Task[Any]]:
        return [asyncio.create_task(c, name=c.__name__) for c in
                (self.publish_all(), self.consume(), self.pull(), self.watch(), self.beat.loop(self.life))]


async def test_services_ride_out_a_server_outage_far_longer_than_the_publish_deadline(tmp_path):
    from rlbus.bus.jetstream import JetStreamBus

    server = EmbeddedServer(tmp_path / "nats")
    await server.astart()
    url = server.url
    opts = dict(BUS_TEST_OPTIONS, publish_deadline=DEADLINE_S)
    producer = await JetStreamBus.connect(url, "outage", name="producer", **opts)
    consumer = await JetStreamBus.connect(url, "outage", name="consumer", **opts)
    p = Pipeline(producer, consumer, n=60)
    tasks = p.start()
    try:
        await producer.publish(p.s.control("generator", "0"), b"before", msg_id="c-before")
        await eventually(lambda: p.published >= 5 and p.watched == [b"before"], timeout=20)

        await server.astop()
        # An object put (a weight upload) started while the server is away waits for it.
        blob = bytes(range(256)) * 12_000  # 3 MB: several chunks
        put = asyncio.create_task(producer.objects.put("weights/outage", blob), name="object-put")
        tasks.append(put)
        for _ in range(int(OUTAGE_S / 0.5)):  # several publish deadlines with the server away
            await asyncio.sleep(0.5)
            crashed = {t.get_name(): t.exception() for t in tasks if t.done()}
            assert not crashed, f"the outage ended service tasks: {crashed}"
        assert p.published < p.n, "the publisher should have been waiting for the server"
        # What services ask the JetStream API meanwhile fails as a bus error they handle, not as
        # nats-py's own timeout (which killed the controller's queue watch in the chaos test).
        with pytest.raises(ServerUnavailable, match="did not answer"):
            await producer.streams()
        with pytest.raises(ServerUnavailable, match="did not answer"):
            await producer.last(p.s.metrics("generator", "0"))

        await server.astart()  # same port, same store
        assert server.url == url
        await producer.publish(p.s.control("generator", "0"), b"after", msg_id="c-after")
        want = {b"t%d" % i for i in range(p.n)}
        await eventually(lambda: set(p.handled) == want and len(p.pulled) == p.n, timeout=60)
        await eventually(lambda: p.watched[-1:] == [b"after"], timeout=60)
        await asyncio.sleep(1.0)  # room for a duplicate to show up

        tasks.remove(put)
        assert (await asyncio.wait_for(put, 60)).size == len(blob)
        assert await consumer.objects.get("weights/outage") == blob
        assert all(n == 1 for n in p.handled.values()), f"handled twice: {p.handled}"
        assert all(n == 1 for n in p.pulled.values()), f"pulled twice: {p.pulled}"
        assert p.watched == [b"before", b"after"]
        assert not [t.get_name() for t in tasks if t.done()], "every service task is still alive"
        assert p.beat.missed > 0  # beats were missed during the outage, and skipped
        assert await producer.last(p.s.metrics("generator", "0")) is not None
        info = await producer.connection.js.stream_info(p.s.stream("TASKS"))
        assert info.state.last_seq == p.n and info.state.messages == 0  # stored once each, all consumed
    finally:
        p.life.shutdown()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await producer.close()
        await consumer.close()
        await server.astop()


async def test_a_dead_letter_that_cannot_be_written_leaves_the_message_for_later(nats_server, run_name):
    from rlbus.bus.jetstream import JetStreamBus

    bus = await JetStreamBus.connect(nats_server.url, run_name, name="trainer",
                                     **dict(BUS_TEST_OPTIONS, publish_deadline=1.0, error_backoff=(0.2, 0.5)))
    try:
        s = bus.subjects
        js = bus.connection.js
        await js.delete_stream(s.stream("DEAD"))  # DEAD unreachable: nothing stores rl.<run>.dead.>
        good = Task(run="r", task_id="g", pool="math", env="addition", prompt="1+1=")
        await bus.publish(s.tasks("math"), b"\x00not msgpack", msg_id="bad")
        await bus.publish(s.tasks("math"), good.encode(), msg_id="good")
        puller = bus.puller(task_spec(bus, ack_wait=30.0, max_deliver=10), Task.decode)

        got = await puller.fetch(5, timeout=2.0)  # must not raise: the dead letter failed, not the pull
        assert [d.msg.task_id for d in got] == ["g"]
        await got[0].ack()
        await eventually(lambda: _stream_messages(bus, "TASKS", 1))  # the bad one is kept, un-acked

        await ensure_streams(js, s)  # DEAD is back
        async with asyncio.timeout(20):
            while not await puller.fetch(5, timeout=0.5) and not await _dead_count(bus):
                pass
        (dl,) = await dead_letters(bus, 1)
        assert dl.reason == "schema_error" and dl.data == b"\x00not msgpack"
        await eventually(lambda: _stream_messages(bus, "TASKS", 0))  # terminated: nothing left behind
    finally:
        await bus.close()


async def _dead_count(bus: Any) -> int:
    info = await bus.connection.js.stream_info(bus.subjects.stream("DEAD"))
    return int(info.state.messages)


async def _stream_messages(bus: Any, kind: str, n: int) -> bool:
    info = await bus.connection.js.stream_info(bus.subjects.stream(kind))
    return int(info.state.messages) == n


async def _exhaust_deliveries(bus: Any, spec_kw: dict[str, Any]) -> bytes:
    """Publish one task and take both its deliveries without settling them; returns its bytes."""
    raw = Task(run="r", task_id="x", pool="math", env="addition", prompt="1+1=").encode()
    await bus.publish(bus.subjects.tasks("math"), raw, msg_id="x")
    puller = bus.puller(task_spec(bus, **spec_kw), Task.decode, heartbeat=False)
    held: list[Any] = []
    async with asyncio.timeout(20):
        while len(held) < spec_kw["max_deliver"]:
            held += await puller.fetch(1, timeout=0.5)
    return raw


async def test_max_deliveries_reached_while_no_consumer_is_connected_is_still_dead_lettered(nats_server, run_name):
    from rlbus.bus.jetstream import JetStreamBus

    spec_kw = dict(ack_wait=1.0, max_deliver=2)
    first = await JetStreamBus.connect(nats_server.url, run_name, name="reward-0", **BUS_TEST_OPTIONS)
    raw = await _exhaust_deliveries(first, spec_kw)
    await first.close()  # the service is gone before the last delivery's ack_wait ends
    await asyncio.sleep(2 * spec_kw["ack_wait"])
    # The server emits the advisory when it next tries to deliver: here for a pull from a client
    # that consumes nothing of its own (the advisory has no rlbus listener at that moment).
    bystander = await JetStreamBus.connect(nats_server.url, run_name, name="bystander", **BUS_TEST_OPTIONS)
    inbox = await bystander.connection.pull_inbox(bystander.subjects.stream("TASKS"), task_spec(bystander).durable)
    assert await inbox.fetch(1, 1.0) == []
    await bystander.close()

    second = await JetStreamBus.connect(nats_server.url, run_name, name="reward-1", **BUS_TEST_OPTIONS)
    try:
        assert await second.puller(task_spec(second, **spec_kw), Task.decode).fetch(1, timeout=0.5) == []
        (dl,) = await dead_letters(second, 1, timeout=20)
        assert dl.reason == "max_deliveries" and dl.data == raw and dl.deliveries >= 2
        await eventually(lambda: _stream_messages(second, "TASKS", 0), timeout=20)  # not stuck in the queue
    finally:
        await second.close()


async def test_a_max_deliveries_dead_letter_that_fails_is_tried_again(nats_server, run_name):
    from rlbus.bus.jetstream import JetStreamBus

    spec_kw = dict(ack_wait=1.0, max_deliver=2)
    bus = await JetStreamBus.connect(nats_server.url, run_name, name="reward-0",
                                     **dict(BUS_TEST_OPTIONS, publish_deadline=1.0))
    try:
        js, s = bus.connection.js, bus.subjects
        await js.delete_stream(s.stream("DEAD"))  # DEAD unreachable when the advisory comes
        raw = await _exhaust_deliveries(bus, spec_kw)
        await asyncio.sleep(2 * spec_kw["ack_wait"])
        assert await bus.puller(task_spec(bus, **spec_kw), Task.decode).fetch(1, timeout=3.0) == []
        await asyncio.sleep(1.5)  # the advisory came, and its dead letter failed
        await ensure_streams(js, s)  # DEAD is back
        (dl,) = await dead_letters(bus, 1, timeout=40)
        assert dl.reason == "max_deliveries" and dl.data == raw
    finally:
        await bus.close()


async def test_declarations_cover_the_advisories_of_every_stream():
    from rlbus.bus.subjects import Subjects

    s = Subjects("adv")
    subjects = set(s.max_deliveries_advisories())
    for d in declarations(s):
        assert f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{d.config.name}.*" in subjects



async def test_a_pull_answered_after_its_fetch_gave_up_is_given_back_not_held(bus):
    """The chaos test's stall: a pull sent before a server outage is answered after it, when its
    fetch has long returned; the generator that sent it had no grant and fetched no more, and its
    heartbeat kept the last tasks of the run in_progress for good while the generator with grant
    found nothing to take.  Such a message must go back to the server for any replica."""
    s = bus.subjects
    spec = task_spec(bus, ack_wait=2.0)
    without_grant = bus.puller(spec, Task.decode)
    assert await without_grant.fetch(1, timeout=0.1) == []
    inbox = without_grant._durable.inbox
    await inbox.request(1, expires=30.0)  # the fetch that sent this is gone: nobody waits for it
    await bus.publish(s.tasks("math"), Task(run="r", task_id="t1", pool="math", env="addition",
                                            prompt="1+1=").encode(), msg_id="t1")
    await eventually(lambda: inbox.received == 1, timeout=10)
    with_grant = bus.puller(spec, Task.decode, heartbeat=False)
    got: list[Delivery[Task]] = []

    async def take() -> bool:
        got.extend(await with_grant.fetch(1, timeout=0.5))
        return bool(got)

    # Held with heartbeats, it would never come back (2.5 x ack_wait here is enough to show it).
    await eventually(take, timeout=5 * spec.ack_wait)
    assert [d.msg.task_id for d in got] == ["t1"]
    assert not inbox.buffer and len(without_grant._durable.heartbeat) == 0
    await got[0].ack()


async def test_no_pull_is_sent_while_disconnected(tmp_path):
    """A fetch during an outage sends nothing (a request left in the client's buffer would reach
    the server on reconnect and take messages for a fetch that ended long before) and waits out
    its timeout as a pull that found nothing would: a caller that fetches in a loop (the
    trainer filling a batch) must leave the event loop to the client's reconnect and the
    heartbeats.  It once returned at once whenever a status or message had arrived after the
    previous fetch, without yielding, and the trainer spun on it for good: never reconnected,
    never heartbeated (the chaos test's outage, measured)."""
    from rlbus.bus.jetstream import JetStreamBus

    server = EmbeddedServer(tmp_path / "nats")
    await server.astart()
    bus = await JetStreamBus.connect(server.url, "away", name="generator", **BUS_TEST_OPTIONS)
    try:
        puller = bus.puller(task_spec(bus), Task.decode)
        assert await puller.fetch(1, timeout=0.1) == []
        inbox = puller._durable.inbox
        await server.astop()
        await eventually(lambda: not bus.connection.nc.is_connected, timeout=10)
        sent = inbox._seq
        inbox._changed.set()  # a status that landed after the last fetch, as a lingering pull's expiry does
        ticks = 0

        async def other_work() -> None:  # the client's reconnect, the heartbeats
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        other = asyncio.create_task(other_work())
        await asyncio.sleep(0)
        t0 = time.monotonic()
        try:
            for _ in range(20):
                assert await puller.fetch(4, timeout=0.05) == []
        finally:
            other.cancel()
        waited, ran = time.monotonic() - t0, ticks
        assert waited >= 20 * 0.05 * 0.9 and ran >= 10, f"fetch spun: 20 fetches in {waited:.3f} s, {ran} ticks"
        assert inbox._seq == sent, "pull requests were queued while the server was away"
        await server.astart()
        await eventually(lambda: bus.connection.nc.is_connected, timeout=30)
        await bus.publish(bus.subjects.tasks("math"), Task(run="r", task_id="t1", pool="math", env="addition",
                                                           prompt="1+1=").encode(), msg_id="t1")
        got = await puller.fetch(1, timeout=5.0)
        assert [d.msg.task_id for d in got] == ["t1"]
        await got[0].ack()
    finally:
        await bus.close()
        await server.astop()


async def test_an_ack_the_server_cannot_get_is_logged_not_raised(tmp_path):
    """A settle during an outage once raised out of the bus (a claim-checked work-queue message's
    ``ack_sync`` timed out) and killed the service that settled (a trainer acking a checkpoint's
    groups).  Now it is logged and the service goes on; the message is not lost: the server
    either redelivers it after ack_wait with its claim still readable, or got the ack the
    client kept in its buffer on reconnect and removed it."""
    from rlbus.bus.jetstream import JetStreamBus

    server = EmbeddedServer(tmp_path / "nats")
    await server.astart()
    bus = await JetStreamBus.connect(server.url, "lost", name="generator", claim_threshold=256, **BUS_TEST_OPTIONS)
    try:
        big = Task(run="r", task_id="t1", pool="math", env="addition", prompt="1+1=" + "9" * 4000)
        await bus.publish(bus.subjects.tasks("math"), big.encode(), msg_id="t1")
        puller = bus.puller(task_spec(bus, ack_wait=2.0), Task.decode)
        [d] = await puller.fetch(1, timeout=5.0)
        await server.astop()
        await eventually(lambda: not bus.connection.nc.is_connected, timeout=10)
        await d.ack()  # raised TimeoutError before
        await d.nak()  # settled once: a no-op
        await server.astart()
        await eventually(lambda: bus.connection.nc.is_connected, timeout=30)
        deadline = time.monotonic() + 15.0
        back: list[Any] = []
        while not back and time.monotonic() < deadline:
            back = await puller.fetch(1, timeout=1.0)
        if back:
            assert back[0].msg.prompt == big.prompt, "the claim was released though the ack never reached the server"
            await back[0].ack()
        info = await bus.connection.js.stream_info(bus.subjects.stream("TASKS"))
        assert info.state.messages == 0, "the message is neither redelivered nor removed"
    finally:
        await bus.close()
        await server.astop()
