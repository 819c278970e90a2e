"""Stream/consumer declarations, request/serve, watch/last, introspection and lifecycle."""

from __future__ import annotations

import asyncio

import pytest

from rlbus.bus.protocol import BusClosed, BusConfigError, ConsumerSpec, RequestFailed, StreamFull
from rlbus.bus.retention import Retention
from rlbus.bus.streams import WEIGHTS_PER_SUBJECT, declarations, ensure_consumer, ensure_streams
from rlbus.bus.subjects import Subjects
from tests.conftest import BUS_TEST_OPTIONS
from tests.integration.helpers import dead_letters, task_spec

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_ensure_streams_is_idempotent_updates_limits_in_place_and_refuses_fixed_fields(bus):
    s = bus.subjects
    js = bus.connection.js
    await ensure_streams(js, s)  # already declared by connect: accepted as equal
    await ensure_streams(js, s)
    tasks = next(d for d in declarations(s) if d.kind == "TASKS").config
    # Someone re-declares TASKS with a retention limit the code does not have: a connection that
    # applies the run's limits puts them back in place, nothing is refused.
    tasks.max_age = 3600.0
    await js.update_stream(tasks)
    await ensure_streams(js, s, retention=Retention(queue_max_msgs=50))
    info = await js.stream_info(s.stream("TASKS"))
    assert (info.config.max_age or 0) == 0 and info.config.max_msgs == 50
    # A tool connecting without the run's limits keeps them.
    await ensure_streams(js, s)
    assert (await js.stream_info(s.stream("TASKS"))).config.max_msgs == 50
    # What cannot change under a stream's messages is refused, naming it.
    await js.delete_stream(s.stream("DEAD"))
    dead = next(d for d in declarations(s) if d.kind == "DEAD").config
    dead.storage = type(dead.storage).MEMORY  # the enum of the declaration (tests do not import nats)
    await js.add_stream(dead)
    with pytest.raises(BusConfigError) as err:
        await ensure_streams(js, s)
    msg = str(err.value)
    assert s.stream("DEAD") in msg and "storage" in msg and "new run name" in msg


async def test_weights_stream_keeps_last_n_per_subject(bus):
    s = bus.subjects
    n = WEIGHTS_PER_SUBJECT + 4
    await bus.publish_many([(s.weights("policy"), f"v{v}".encode(), f"w{v}") for v in range(n)])
    state = {st.name: st for st in await bus.streams()}
    assert state[s.stream("WEIGHTS")].messages == WEIGHTS_PER_SUBJECT
    assert await bus.last(s.weights("policy")) == f"v{n - 1}".encode()
    assert await bus.last(s.weights("other")) is None


async def test_ensure_consumer_updates_tunables_in_place_and_refuses_changed_filters(bus):
    s = bus.subjects
    js = bus.connection.js
    spec = task_spec(bus, ack_wait=2.0)
    await ensure_consumer(js, s, spec)
    await ensure_consumer(js, s, spec)
    await bus.publish_many([(s.tasks("math"), b"x", f"t{i}") for i in range(3)])
    (held,) = await bus.puller(spec, bytes, heartbeat=False).fetch(1, timeout=2.0)
    changed = ConsumerSpec(stream="TASKS", durable=spec.durable, filter_subjects=spec.filter_subjects, ack_wait=9.0,
                           max_deliver=7, max_ack_pending=77)
    await ensure_consumer(js, s, changed)
    info = await js.consumer_info(s.stream("TASKS"), spec.durable)
    assert (info.config.ack_wait, info.config.max_deliver, info.config.max_ack_pending) == (9.0, 7, 77)
    assert (info.num_pending, info.num_ack_pending) == (2, 1)  # position and the held message kept
    await held.ack()
    other_filter = ConsumerSpec(stream="TASKS", durable=spec.durable, filter_subjects=(s.tasks("code"),))
    with pytest.raises(BusConfigError, match="cannot change in place") as err:
        await ensure_consumer(js, s, other_filter)
    assert "new run name" in str(err.value)
    overlapping = ConsumerSpec(stream="TASKS", durable="all_tasks", filter_subjects=(s.all_of("tasks"),))
    with pytest.raises(BusConfigError, match="work-queue"):
        await ensure_consumer(js, s, overlapping)


async def test_changing_the_trainers_run_config_keeps_its_durable_and_position(nats_server, run_name):
    from rlbus.bus.jetstream import JetStreamBus
    from rlbus.services.runtime.config import RunSettings
    from rlbus.services.trainer.intake import consumer_spec
    from rlbus.services.trainer.settings import TrainerSettings

    before = RunSettings(run=run_name, pools=["math"], batch_groups=4, max_staleness=1)
    after = RunSettings(run=run_name, pools=["math"], batch_groups=8, max_staleness=3)
    specs = [consumer_spec(before, TrainerSettings(checkpoint_every=2), Subjects(run_name)),
             consumer_spec(after, TrainerSettings(checkpoint_every=20, ack_wait=45.0), Subjects(run_name))]
    assert specs[0] != specs[1]
    got: list[bytes] = []
    for i, spec in enumerate(specs):  # the trainer restarted with the new config
        b = await JetStreamBus.connect(nats_server.url, run_name, name=f"trainer-{i}")
        try:
            if i == 0:
                await b.publish_many([(b.subjects.scored("math"), b"g%d" % j, f"g{j}") for j in range(6)])
            for d in await b.puller(spec, bytes).fetch(3, timeout=2.0):
                got.append(d.msg)
                await d.ack()
        finally:
            await b.close()
    assert got == [b"g%d" % j for j in range(6)]  # no replay, nothing skipped


async def test_full_streams_refuse_with_a_clear_error_and_lose_nothing(nats_server, run_name):
    from rlbus.bus.jetstream import JetStreamBus

    limits = Retention(queue_max_msgs=3, dead_max_msgs=1, control_per_subject=2)
    b = await JetStreamBus.connect(nats_server.url, run_name, name="small", retention=limits,
                                   **dict(BUS_TEST_OPTIONS, publish_deadline=1.0, error_backoff=(0.2, 0.5)))
    try:
        s = b.subjects
        for i in range(3):
            await b.publish(s.tasks("math"), b"t%d" % i, msg_id=f"t{i}")
        with pytest.raises(StreamFull) as err:
            await b.publish(s.tasks("math"), b"t3", msg_id="t3")
        msg = str(err.value)
        assert s.stream("TASKS") in msg and "maximum messages" in msg and "[run.retention] queue_max_msgs" in msg
        spec = task_spec(b, ack_wait=30.0, max_deliver=10)
        puller = b.puller(spec, bytes)
        first = await puller.fetch(3, timeout=2.0)
        assert [d.msg for d in first] == [b"t0", b"t1", b"t2"]  # the queue kept what it had
        await first[0].ack()
        await b.publish(s.tasks("math"), b"t3", msg_id="t3")  # room again: accepted
        # CONTROL keeps the last N per subject, and so always the latest decision of each.
        for i in range(4):
            await b.publish(s.control_action("generator", "0", "admit"), b"a%d" % i, msg_id=f"a{i}")
        await b.publish(s.control_action("generator", "0", "pause"), b"p", msg_id="p")
        assert await b.last(s.control_action("generator", "0", "admit")) == b"a3"
        assert await b.last(s.control_action("generator", "0", "pause")) == b"p"
        assert (await b.connection.js.stream_info(s.stream("CONTROL"))).state.messages == 3
        # A full DEAD refuses the dead letter: the bad message stays un-acked and is retried.
        await b.dead_letter(s.tasks("math"), b"older", error="x", reason="test")
        await first[1].term("poison")
        assert (await b.connection.js.stream_info(s.stream("TASKS"))).state.messages == 3
        await ensure_streams(b.connection.js, s, retention=Retention(queue_max_msgs=3, dead_max_msgs=10))
        async with asyncio.timeout(20):
            while (await b.connection.js.stream_info(s.stream("DEAD"))).state.messages < 2:
                for d in await puller.fetch(3, timeout=0.5):
                    if d.msg == b"t1":
                        await d.term("poison")
        (_, dl) = await dead_letters(b, 2)
        assert dl.reason == "poison" and dl.data == b"t1"
    finally:
        await b.close()


async def test_request_serve_round_trip_errors_and_no_responders(bus):
    subject = bus.subjects.env("addition", "step")

    async def handler(data: bytes) -> bytes:
        if data == b"bad":
            raise ValueError("episode 7 does not exist")
        return data.upper()

    await bus.serve(bus.subjects.env_any("step"), handler, queue=bus.subjects.env_queue_group)
    assert await bus.request(subject, b"hello", timeout=2.0) == b"HELLO"
    replies = await asyncio.gather(*(bus.request(subject, b"x%d" % i, timeout=2.0) for i in range(20)))
    assert replies == [b"X%d" % i for i in range(20)]
    with pytest.raises(RequestFailed, match="episode 7 does not exist"):
        await bus.request(subject, b"bad", timeout=2.0)
    with pytest.raises(RequestFailed, match="no responders"):
        await bus.request(bus.subjects.env("nobody", "reset"), b"", timeout=1.0)


async def test_watch_new_and_last_per_subject(bus):
    s = bus.subjects
    await bus.publish(s.control("generator", "0"), b"old", msg_id="c1")
    await bus.publish(s.control("generator", "0"), b"current", msg_id="c2")
    w = bus.watch(s.control("generator", "0"), deliver="last_per_subject")
    async with asyncio.timeout(5):
        first = await w.__anext__()
        await bus.publish(s.control("generator", "0"), b"next", msg_id="c3")
        second = await w.__anext__()
    assert (first.msg, second.msg) == (b"current", b"next")
    assert second.msg_id == "c3"
    await w.aclose()
    with pytest.raises(StopAsyncIteration):
        await w.__anext__()


async def test_streams_reports_consumer_state(bus):
    s = bus.subjects
    await bus.publish_many([(s.tasks("math"), b"x", f"t{i}") for i in range(3)])
    puller = bus.puller(task_spec(bus), bytes)
    (d,) = await puller.fetch(1, timeout=1.0)
    states = {st.name: st for st in await bus.streams()}
    tasks = states[s.stream("TASKS")]
    (c,) = tasks.consumers
    assert (tasks.messages, c.pending, c.ack_pending) == (3, 2, 1)
    assert states[s.stream("DEAD")].messages == 0
    await d.ack()


async def test_close_is_idempotent_and_final(nats_server, run_name):
    from rlbus.bus.jetstream import JetStreamBus

    b = await JetStreamBus.connect(nats_server.url, run_name, name="closer")
    await b.close()
    await b.close()
    with pytest.raises(BusClosed):
        await b.publish(b.subjects.tasks("math"), b"x", msg_id="late")


async def test_connect_to_nothing_fails_fast_with_a_clear_error():
    from rlbus.bus.jetstream import JetStreamBus
    from rlbus.bus.protocol import BusError

    with pytest.raises(BusError, match="cannot connect to NATS"):
        await JetStreamBus.connect("nats://127.0.0.1:1", "nobody", name="x", connect_timeout=1.0)


async def test_a_full_object_bucket_refuses_a_put_and_keeps_what_it_has(nats_server, run_name):
    from rlbus.bus.jetstream import JetStreamBus

    b = await JetStreamBus.connect(nats_server.url, run_name, name="objects",
                                   retention=Retention(objects_max_bytes=3 * 1024 * 1024))
    try:
        await b.objects.put("weights/v1", b"a" * (2 * 1024 * 1024))
        with pytest.raises(StreamFull) as err:
            await b.objects.put("weights/v2", b"b" * (2 * 1024 * 1024))
        msg = str(err.value)
        assert f"OBJ_{b.subjects.object_bucket}" in msg and "[run.retention] objects_max_mib" in msg
        assert await b.objects.get("weights/v1") == b"a" * (2 * 1024 * 1024)  # untouched
        await b.objects.delete("weights/v1")  # what weight-broadcast does past its keep_versions
        await b.objects.put("weights/v2", b"b" * (2 * 1024 * 1024))
    finally:
        await b.close()
    # A raised [run.retention] objects_max_mib reaches the live bucket in place.
    b = await JetStreamBus.connect(nats_server.url, run_name, name="objects",
                                   retention=Retention(objects_max_bytes=8 * 1024 * 1024))
    try:
        await b.objects.put("weights/v3", b"c" * (2 * 1024 * 1024))
        assert [o.name for o in await b.objects.list()] == ["weights/v2", "weights/v3"]
    finally:
        await b.close()
