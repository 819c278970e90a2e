"""Stream/consumer declarations, request/serve, watch/last, introspection and lifecycle."""

from __future__ import annotations

import asyncio

import pytest

from bus.protocol import BusClosed, BusConfigError, ConsumerSpec, RequestFailed
from bus.streams import declarations, ensure_consumer, ensure_streams
from tests.integration.helpers import task_spec

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_ensure_streams_is_idempotent_and_refuses_conflicts(bus):
    s = bus.subjects
    await ensure_streams(bus.connection.js, s)  # already declared by connect: accepted as equal
    await ensure_streams(bus.connection.js, s)
    tasks = next(d for d in declarations(s) if d.kind == "TASKS").config
    # Someone re-declares TASKS with a retention limit the code does not have.
    tasks.max_age = 3600.0
    await bus.connection.js.update_stream(tasks)
    with pytest.raises(BusConfigError) as err:
        await ensure_streams(bus.connection.js, s)
    msg = str(err.value)
    assert s.stream("TASKS") in msg and "max_age" in msg
    assert "new run name" in msg


async def test_weights_stream_keeps_last_n_per_subject(bus):
    s = bus.subjects
    for v in range(12):
        await bus.publish(s.weights("policy"), f"v{v}".encode(), msg_id=f"w{v}")
    state = {st.name: st for st in await bus.streams()}
    assert state[s.stream("WEIGHTS")].messages == 8
    assert await bus.last(s.weights("policy")) == b"v11"
    assert await bus.last(s.weights("other")) is None


async def test_ensure_consumer_refuses_changed_or_overlapping_durables(bus):
    s = bus.subjects
    spec = task_spec(bus, ack_wait=2.0)
    await ensure_consumer(bus.connection.js, s, spec)
    await ensure_consumer(bus.connection.js, s, spec)
    changed = ConsumerSpec(stream="TASKS", durable=spec.durable, filter_subjects=spec.filter_subjects, ack_wait=9.0)
    with pytest.raises(BusConfigError, match="ack_wait"):
        await ensure_consumer(bus.connection.js, s, changed)
    overlapping = ConsumerSpec(stream="TASKS", durable="all_tasks", filter_subjects=(s.all_of("tasks"),))
    with pytest.raises(BusConfigError, match="work-queue"):
        await ensure_consumer(bus.connection.js, s, overlapping)


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
    from bus.jetstream import JetStreamBus

    b = await JetStreamBus.connect(nats_server.url, run_name, name="closer")
    await b.close()
    await b.close()
    with pytest.raises(BusClosed):
        await b.publish(b.subjects.tasks("math"), b"x", msg_id="late")


async def test_connect_to_nothing_fails_fast_with_a_clear_error():
    from bus.jetstream import JetStreamBus
    from bus.protocol import BusError

    with pytest.raises(BusError, match="cannot connect to NATS"):
        await JetStreamBus.connect("nats://127.0.0.1:1", "nobody", name="x", connect_timeout=1.0)
