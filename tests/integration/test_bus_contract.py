"""The bus contract: every test runs against ``MemoryBus`` and a ``JetStreamBus`` on a real server.

What a service may rely on, whichever bus it is given: publish dedupe, the handler outcome rules
(ack, ``Retry``, ``Poison``, decode errors, max deliveries), work-queue sharing, graceful stop,
pullers, request/reply, watch/last.  When ``MemoryBus`` fails here, ``MemoryBus`` is wrong.
What only a real server can show (ack_wait, heartbeats, restarts, claim check, byte limits)
is in the JetStream-only ``test_bus_*.py`` files.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rlbus.bus.memory import MemoryBus
from rlbus.bus.protocol import BusClosed, BusConfigError, BusError, ConsumerSpec, Delivery, Poison, RequestFailed, Retry
from rlbus.schemas import SchemaError, Task
from tests.conftest import BUS_TEST_OPTIONS
from tests.integration.helpers import consuming, dead_letters, eventually, stream_messages, task_spec

pytestmark = pytest.mark.asyncio


@pytest.fixture(params=["memory", pytest.param("jetstream", marks=pytest.mark.integration)])
async def any_bus(request: pytest.FixtureRequest, run_name: str) -> AsyncIterator[Any]:
    if request.param == "memory":
        b: Any = MemoryBus(run_name, name="test", error_backoff=BUS_TEST_OPTIONS["error_backoff"],
                           shutdown_grace=BUS_TEST_OPTIONS["shutdown_grace"])
    else:
        from rlbus.bus.jetstream import JetStreamBus

        server = request.getfixturevalue("nats_server")
        b = await JetStreamBus.connect(server.url, run_name, name="test", **BUS_TEST_OPTIONS)
    try:
        yield b
    finally:
        await b.close()


def _task(i: int, pool: str = "math") -> bytes:
    return Task(run="r", task_id=f"t{i}", pool=pool, env="addition", prompt=f"{i}+1=").encode()


async def _empty(bus: Any, kind: str) -> bool:
    return await stream_messages(bus, kind) == 0


# --- publish -----------------------------------------------------------------------------------


async def test_publish_dedupes_by_msg_id(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), _task(1), msg_id="task-1")
    await any_bus.publish(s.tasks("math"), _task(1), msg_id="task-1")  # a retry
    await any_bus.publish_many([(s.tasks("math"), _task(1), "task-1"), (s.tasks("math"), _task(2), "task-2")])
    assert await stream_messages(any_bus, "TASKS") == 2


async def test_publish_refuses_a_missing_msg_id_and_bad_headers(any_bus):
    s = any_bus.subjects
    with pytest.raises(BusError, match="msg_id"):
        await any_bus.publish(s.tasks("math"), _task(1), msg_id="")
    with pytest.raises(BusError, match="CR/LF"):
        await any_bus.publish(s.tasks("math"), _task(1), msg_id="t1", headers={"x-bad": "a\r\nb"})
    with pytest.raises(BusError, match="budget"):
        await any_bus.publish(s.tasks("math"), _task(1), msg_id="t1", headers={"x-big": "x" * 8192})
    assert await stream_messages(any_bus, "TASKS") == 0


# --- handler outcomes --------------------------------------------------------------------------


async def test_delivery_carries_subject_id_count_sequence_and_headers(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), _task(1), msg_id="t1", headers={"x-origin": "feeder"})
    seen: list[Delivery[Task]] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        seen.append(d)

    async with consuming(any_bus, task_spec(any_bus), Task.decode, handler):
        await eventually(lambda: seen)
    (d,) = seen
    assert (d.msg.task_id, d.subject, d.msg_id, d.deliveries) == ("t1", s.tasks("math"), "t1", 1)
    assert d.stream_seq > 0 and d.headers["x-origin"] == "feeder"
    await eventually(lambda: _empty(any_bus, "TASKS"))  # returned normally: acked


async def test_retry_redelivers_after_its_delay_with_deliveries_incremented(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), _task(1), msg_id="t1")
    seen: list[tuple[int, float]] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        seen.append((d.deliveries, time.monotonic()))
        if d.deliveries == 1:
            raise Retry("environment busy", delay=0.6)

    async with consuming(any_bus, task_spec(any_bus), Task.decode, handler):
        await eventually(lambda: len(seen) >= 2)
        await eventually(lambda: _empty(any_bus, "TASKS"))
    assert [n for n, _ in seen] == [1, 2]
    assert seen[1][1] - seen[0][1] >= 0.5
    assert await stream_messages(any_bus, "DEAD") == 0


async def test_poison_dead_letters_the_reason_and_the_original_bytes(any_bus):
    s = any_bus.subjects
    raw = _task(7)
    await any_bus.publish(s.tasks("math"), raw, msg_id="t7")
    calls: list[int] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        calls.append(d.deliveries)
        raise Poison("prompt references a deleted dataset")

    async with consuming(any_bus, task_spec(any_bus), Task.decode, handler):
        (dl,) = await dead_letters(any_bus, 1)
        await eventually(lambda: _empty(any_bus, "TASKS"))
    assert calls == [1]  # never retried
    assert (dl.reason, dl.error, dl.data) == ("prompt references a deleted dataset", "Poison", raw)
    assert dl.origin_subject == s.tasks("math") and dl.headers.get("Nats-Msg-Id") == "t7"
    assert dl.service == "test" and dl.deliveries == 1 and dl.stream_seq > 0


async def test_malformed_payload_is_dead_lettered_and_the_handler_never_sees_it(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), b"\xc1 definitely not msgpack", msg_id="bad")
    await any_bus.publish(s.tasks("math"), _task(2), msg_id="good")
    handled: list[str] = []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        handled.append(task.task_id)

    async with consuming(any_bus, task_spec(any_bus), Task.decode, handler):
        await eventually(lambda: handled == ["t2"])
        (dl,) = await dead_letters(any_bus, 1)
        await eventually(lambda: _empty(any_bus, "TASKS"))
    assert handled == ["t2"]
    assert dl.reason == "schema_error" and "SchemaError" in dl.error and "not valid msgpack" in dl.error
    assert dl.data == b"\xc1 definitely not msgpack"
    with pytest.raises(SchemaError):
        Task.decode(dl.data)


async def test_a_decoder_failing_otherwise_is_a_decode_error(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), b"\xff\xfe", msg_id="latin")
    handled: list[str] = []

    async def handler(text: str, d: Delivery[str]) -> None:
        handled.append(text)

    async with consuming(any_bus, task_spec(any_bus), lambda b: b.decode("utf-8"), handler):
        (dl,) = await dead_letters(any_bus, 1)
    assert handled == []
    assert dl.reason == "decode_error" and "UnicodeDecodeError" in dl.error and dl.data == b"\xff\xfe"


async def test_repeated_failures_are_dead_lettered_after_max_deliver_with_the_last_error(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), _task(3), msg_id="t3")
    await any_bus.publish(s.tasks("math"), _task(4), msg_id="t4")
    calls: dict[str, list[int]] = {"t3": [], "t4": []}

    async def handler(task: Task, d: Delivery[Task]) -> None:
        calls[task.task_id].append(d.deliveries)
        if task.task_id == "t3":
            raise RuntimeError(f"verifier crashed on try {d.deliveries}")
        raise Retry("environment busy", delay=0.1)

    async with consuming(any_bus, task_spec(any_bus, max_deliver=3), Task.decode, handler):
        letters = await dead_letters(any_bus, 2, timeout=15)
        await eventually(lambda: _empty(any_bus, "TASKS"))  # removed from the work queue, not stuck
    assert calls == {"t3": [1, 2, 3], "t4": [1, 2, 3]}
    by_task = {Task.decode(dl.data).task_id: dl for dl in letters}
    assert by_task["t3"].data == _task(3)
    assert {dl.reason for dl in letters} == {"max_deliveries"}
    assert {dl.deliveries for dl in letters} == {3}
    assert "RuntimeError: verifier crashed on try 3" in by_task["t3"].error
    assert by_task["t4"].error == "Retry: environment busy"


# --- sharing, concurrency, stopping --------------------------------------------------------------


async def test_two_consumers_of_one_durable_split_the_work_queue(any_bus):
    s = any_bus.subjects
    await any_bus.publish_many([(s.tasks("math"), _task(i), f"t{i}") for i in range(30)])
    handled: dict[str, list[str]] = {"a": [], "b": []}

    def handler_of(who: str) -> Any:
        async def handler(task: Task, d: Delivery[Task]) -> None:
            await asyncio.sleep(0.01)
            handled[who].append(task.task_id)
        return handler

    spec = task_spec(any_bus)
    async with consuming(any_bus, spec, Task.decode, handler_of("a"), batch=4), \
            consuming(any_bus, spec, Task.decode, handler_of("b"), batch=4):
        await eventually(lambda: len(handled["a"]) + len(handled["b"]) >= 30)
        await eventually(lambda: _empty(any_bus, "TASKS"))
    everything = handled["a"] + handled["b"]
    assert sorted(everything) == sorted(f"t{i}" for i in range(30))  # each exactly once
    assert handled["a"] and handled["b"]


async def test_overlapping_work_queue_durables_are_refused(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), _task(1, "math"), msg_id="m")
    await any_bus.publish(s.tasks("code"), _task(2, "code"), msg_id="c")
    math = await any_bus.puller(task_spec(any_bus, "math"), Task.decode).fetch(5, timeout=1.0)
    code = await any_bus.puller(task_spec(any_bus, "code"), Task.decode).fetch(5, timeout=1.0)
    assert [d.msg.pool for d in math] == ["math"] and [d.msg.pool for d in code] == ["code"]
    everything = ConsumerSpec(stream="TASKS", durable="all_tasks", filter_subjects=(s.all_of("tasks"),))
    with pytest.raises(BusConfigError, match="work-queue"):
        await any_bus.puller(everything, Task.decode).fetch(1, timeout=0.1)


async def test_concurrency_runs_that_many_handlers_at_once(any_bus):
    s = any_bus.subjects
    await any_bus.publish_many([(s.tasks("math"), _task(i), f"t{i}") for i in range(8)])
    now, peak, done = 0, 0, []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        await asyncio.sleep(0.2)
        now -= 1
        done.append(task.task_id)

    async with consuming(any_bus, task_spec(any_bus), Task.decode, handler, batch=4, concurrency=4):
        await eventually(lambda: len(done) == 8)
    assert peak == 4


async def test_cancelled_consume_lets_a_running_handler_finish_within_the_grace(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), _task(1), msg_id="t1")
    started, finished = asyncio.Event(), []

    async def handler(task: Task, d: Delivery[Task]) -> None:
        started.set()
        await asyncio.sleep(0.5)  # well inside the 2 s shutdown_grace of the test buses
        finished.append(task.task_id)

    async with consuming(any_bus, task_spec(any_bus, ack_wait=30.0), Task.decode, handler):
        await asyncio.wait_for(started.wait(), 10)
    assert finished == ["t1"]
    await eventually(lambda: _empty(any_bus, "TASKS"))  # acked, not handed back


async def test_a_handler_outliving_the_grace_is_naked_for_another_consumer(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), _task(1), msg_id="t1")
    started = asyncio.Event()

    async def stuck(task: Task, d: Delivery[Task]) -> None:
        started.set()
        await asyncio.sleep(60)

    spec = task_spec(any_bus, ack_wait=30.0)
    async with consuming(any_bus, spec, Task.decode, stuck):
        await asyncio.wait_for(started.wait(), 10)
    # Naked on the way out: a new consumer gets it now, long before the 30 s ack_wait.
    got = await any_bus.puller(spec, Task.decode).fetch(1, timeout=3.0)
    assert [(d.msg.task_id, d.deliveries) for d in got] == [("t1", 2)]
    await got[0].ack()


async def test_closing_the_bus_stops_consume_with_bus_closed(any_bus):
    async def handler(task: Task, d: Delivery[Task]) -> None:
        return None

    task = asyncio.create_task(any_bus.consume(task_spec(any_bus), Task.decode, handler))
    await asyncio.sleep(0.3)
    await any_bus.close()
    with pytest.raises(BusClosed):
        await asyncio.wait_for(task, 10)
    with pytest.raises(BusClosed):
        await any_bus.publish(any_bus.subjects.tasks("math"), _task(1), msg_id="late")


# --- pullers -----------------------------------------------------------------------------------


async def test_puller_fetch_then_ack_nak_and_term(any_bus):
    s = any_bus.subjects
    await any_bus.publish_many([(s.tasks("math"), _task(i), f"t{i}") for i in range(1, 4)])
    p = any_bus.puller(task_spec(any_bus, ack_wait=30.0), Task.decode)
    assert await p.pending() == 3
    got = await p.fetch(5, timeout=2.0)
    assert [d.msg.task_id for d in got] == ["t1", "t2", "t3"] and {d.deliveries for d in got} == {1}
    assert await p.pending() == 0
    assert await p.fetch(5, timeout=0.2) == []  # in flight: not handed out twice
    t1, t2, t3 = got
    await t3.ack()
    await t3.nak()  # a second settlement is ignored
    await t2.term("the environment refused it")
    await t1.nak(delay=0.5)
    assert await p.pending() == 0  # delivered once already: waiting for redelivery, not pending
    t0 = time.monotonic()
    again: list[Delivery[Task]] = []
    async with asyncio.timeout(5):
        while not again:
            again = await p.fetch(5, timeout=1.0)
    assert [(d.msg.task_id, d.deliveries) for d in again] == [("t1", 2)]
    assert time.monotonic() - t0 >= 0.4
    await again[0].ack()
    (dl,) = await dead_letters(any_bus, 1)
    assert (dl.reason, dl.error, dl.data) == ("the environment refused it", "terminated", _task(2))
    await eventually(lambda: _empty(any_bus, "TASKS"))


async def test_puller_dead_letters_bad_messages_and_returns_good_ones(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.tasks("math"), b"junk", msg_id="bad")
    await any_bus.publish(s.tasks("math"), _task(5), msg_id="t5")
    p = any_bus.puller(task_spec(any_bus), Task.decode)
    got: list[Delivery[Task]] = []
    async with asyncio.timeout(5):
        while not got:
            got = await p.fetch(10, timeout=0.5)
    assert [d.msg.task_id for d in got] == ["t5"]
    await got[0].ack()
    (dl,) = await dead_letters(any_bus, 1)
    assert dl.reason == "schema_error" and dl.data == b"junk"
    await eventually(lambda: _empty(any_bus, "TASKS"))


async def test_a_durables_tunables_change_in_place_and_its_filter_cannot(any_bus):
    s = any_bus.subjects
    await any_bus.publish_many([(s.tasks("math"), _task(i), f"t{i}") for i in range(3)])
    (held,) = await any_bus.puller(task_spec(any_bus, ack_wait=30.0), Task.decode).fetch(1, timeout=2.0)
    # A restarted consumer with other ack_wait / max_deliver / max_ack_pending: same durable,
    # same position, the held message still held (not handed out again).
    p = any_bus.puller(task_spec(any_bus, ack_wait=45.0, max_deliver=9, max_ack_pending=50), Task.decode)
    got = await p.fetch(5, timeout=2.0)
    assert [d.msg.task_id for d in got] == ["t1", "t2"]
    for d in [held, *got]:
        await d.ack()
    moved = ConsumerSpec(stream="TASKS", durable=task_spec(any_bus).durable, filter_subjects=(s.tasks("code"),))
    with pytest.raises(BusConfigError, match="cannot change in place"):
        await any_bus.puller(moved, Task.decode).fetch(1, timeout=0.1)


async def test_a_limits_stream_keeps_acked_messages_for_every_durable(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.scored("math"), b"x", msg_id="sc1")
    for durable in ("trainer", "replay"):
        spec = ConsumerSpec(stream="SCORED", durable=durable, filter_subjects=(s.all_of("scored"),))
        (d,) = await any_bus.puller(spec, bytes).fetch(1, timeout=2.0)
        assert d.msg == b"x"
        await d.ack()
    await asyncio.sleep(0.1)
    assert await stream_messages(any_bus, "SCORED") == 1


# --- request / reply ---------------------------------------------------------------------------


async def test_request_reply_errors_no_responders_and_timeout(any_bus):
    s = any_bus.subjects

    async def handler(data: bytes) -> bytes:
        if data == b"bad":
            raise ValueError("episode 7 does not exist")
        if data == b"slow":
            await asyncio.sleep(2.0)
        return data.upper()

    await any_bus.serve(s.env_any("step"), handler, queue=s.env_queue_group)
    subject = s.env("addition", "step")
    assert await any_bus.request(subject, b"hello", timeout=2.0) == b"HELLO"
    replies = await asyncio.gather(*(any_bus.request(subject, b"x%d" % i, timeout=2.0) for i in range(10)))
    assert replies == [b"X%d" % i for i in range(10)]
    with pytest.raises(RequestFailed, match="ValueError: episode 7 does not exist"):
        await any_bus.request(subject, b"bad", timeout=2.0)
    with pytest.raises(RequestFailed, match="no responders"):
        await any_bus.request(s.env("nobody", "reset"), b"", timeout=1.0)
    with pytest.raises(RequestFailed, match="no reply within"):
        await any_bus.request(subject, b"slow", timeout=0.3)


# --- watch / last ------------------------------------------------------------------------------


async def test_watch_last_per_subject_then_new_messages_and_last(any_bus):
    s = any_bus.subjects
    await any_bus.publish(s.control("generator", "0"), b"old", msg_id="c1")
    await any_bus.publish(s.control("generator", "0"), b"current", msg_id="c2")
    await any_bus.publish(s.control("generator", "1"), b"other", msg_id="c3")
    w = any_bus.watch(s.control("generator", "0"), deliver="last_per_subject")
    async with asyncio.timeout(5):
        first = await w.__anext__()
        await any_bus.publish(s.control("generator", "0"), b"next", msg_id="c4")
        second = await w.__anext__()
    assert (first.msg, second.msg) == (b"current", b"next")
    assert (first.msg_id, second.msg_id) == ("c2", "c4") and second.subject == s.control("generator", "0")
    await w.aclose()
    for _ in range(2):
        with pytest.raises(StopAsyncIteration):
            await w.__anext__()
    assert await any_bus.last(s.control("generator", "0")) == b"next"
    assert await any_bus.last(s.control("generator", "1")) == b"other"
    assert await any_bus.last(s.control("nobody", "0")) is None


async def test_watch_all_replays_a_wildcard_in_order(any_bus):
    s = any_bus.subjects
    for i in range(3):
        await any_bus.publish(s.metrics("reward", str(i)), b"m%d" % i, msg_id=f"m{i}")
    got = []
    async with asyncio.timeout(5):
        async for d in any_bus.watch(s.metrics_of("reward"), deliver="all"):
            got.append(d.msg)
            if len(got) == 3:
                break
    assert got == [b"m0", b"m1", b"m2"]
