"""On a real nats-server: the UPLOADS work queue (refusal at its limit, acked away by
weight-broadcast) and the max-deliveries advisories followed per durable, not per run."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import pytest

from rlbus.bus.protocol import ConsumerSpec, StreamFull
from rlbus.bus.retention import Retention

# nats types through rlbus.bus.streams: only bus/ imports nats (tests/unit/test_imports.py)
from rlbus.bus.streams import LEGACY_ADVISORY_DURABLE, NotFoundError, api
from rlbus.schemas import Shard, Task, WeightManifest
from tests.conftest import BUS_TEST_OPTIONS
from tests.integration.helpers import broadcast_running, dead_letters, eventually, task_spec

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def manifest(version: int, location: str, data: bytes) -> WeightManifest:
    return WeightManifest(model="policy", version=version, transport="objstore", state="uploaded",
                          shards=[Shard(name="model.safetensors", sha256=hashlib.sha256(data).hexdigest(),
                                        size=len(data), location=location)])


async def messages(bus: Any, kind: str) -> int:
    return int((await bus.connection.js.stream_info(bus.subjects.stream(kind))).state.messages)


async def test_a_full_uploads_queue_refuses_the_new_upload_and_keeps_the_queued_ones(nats_server, run_name):
    from rlbus.bus.jetstream import JetStreamBus

    b = await JetStreamBus.connect(nats_server.url, run_name, name="trainer", retention=Retention(queue_max_msgs=3),
                                   **dict(BUS_TEST_OPTIONS, publish_deadline=1.0))
    try:
        s = b.subjects
        for v in range(1, 4):
            await b.publish(s.weight_uploads("policy"), manifest(v, "x", b"x").encode(), msg_id=f"u{v}")
        with pytest.raises(StreamFull) as err:
            await b.publish(s.weight_uploads("policy"), manifest(4, "x", b"x").encode(), msg_id="u4")
        msg = str(err.value)
        assert s.stream("UPLOADS") in msg and "[run.retention] queue_max_msgs" in msg
        assert await messages(b, "UPLOADS") == 3  # discard new: the oldest, unread, is still there
        assert await messages(b, "WEIGHTS") == 0  # uploads no longer touch the manifests' stream
    finally:
        await b.close()


async def test_weight_broadcast_acks_every_upload_away_verified_or_refused(bus, run_name, tmp_path):
    s = bus.subjects
    data = b"safetensors bytes of v1"
    await bus.objects.put("weights/policy/v1/model.safetensors", data)
    good = manifest(1, "weights/policy/v1/model.safetensors", data)
    forged = [manifest(v, f"weights/policy/forged{v}", b"%d" % v) for v in range(2, 40)]
    await bus.publish_many([(s.weight_uploads("policy"), m.encode(), m.msg_id) for m in [good, *forged]])
    assert await messages(bus, "UPLOADS") == 1 + len(forged)
    async with broadcast_running(bus, run_name, tmp_path) as service:
        await eventually(lambda: service.b.latest == 1 and service.b.refused == len(forged), timeout=60)
        # The work queue is emptied by the acks: nothing left for a replay, nothing pending.
        await eventually(_empty(bus), timeout=20)
    info = await bus.connection.js.consumer_info(s.stream("UPLOADS"), s.durable("broadcast"))
    assert (info.num_pending, info.num_ack_pending) == (0, 0)
    letters = await dead_letters(bus, len(forged), timeout=30)
    assert {d.origin_subject for d in letters} == {s.weight_uploads("policy")}
    assert WeightManifest.decode(await bus.last(s.weights("policy"))).version == 1


def _empty(bus: Any) -> Any:
    async def check() -> bool:
        return await messages(bus, "UPLOADS") == 0
    return check


async def _exhaust(bus: Any, pool: str) -> bytes:
    """One task on ``pool`` whose two deliveries are taken and never settled."""
    raw = Task(run="r", task_id=f"x-{pool}", pool=pool, env="addition", prompt="1+1=").encode()
    await bus.publish(bus.subjects.tasks(pool), raw, msg_id=f"x-{pool}")
    puller = bus.puller(task_spec(bus, pool, ack_wait=1.0, max_deliver=2), Task.decode, heartbeat=False)
    held: list[Any] = []
    async with asyncio.timeout(20):
        while len(held) < 2:
            held += await puller.fetch(1, timeout=0.5)
    return raw


async def _advisory_deliveries(bus: Any, kind: str, durable: str) -> int:
    s = bus.subjects
    try:
        info = await bus.connection.js.consumer_info(s.advisory_stream, s.advisory_durable(kind, durable))
    except NotFoundError:
        return -1
    return int(info.delivered.stream_seq or 0)


async def test_an_advisory_reaches_only_the_connections_that_consume_its_durable(nats_server, run_name):
    """A connection that consumes ROLLOUTS never receives the advisory of a TASKS durable: it
    could not read that message under least privilege, only hand it back."""
    from rlbus.bus.jetstream import JetStreamBus

    gen = await JetStreamBus.connect(nats_server.url, run_name, name="gen", **BUS_TEST_OPTIONS)
    rew = await JetStreamBus.connect(nats_server.url, run_name, name="rew", **BUS_TEST_OPTIONS)
    try:
        s = rew.subjects
        rollouts = ConsumerSpec(stream="ROLLOUTS", durable="reward", filter_subjects=(s.all_of("rollouts"),))
        await rew.puller(rollouts, bytes).fetch(1, timeout=0.2)
        raw = await _exhaust(gen, "math")
        await asyncio.sleep(2.0)  # the last delivery's ack_wait ends; the next pull makes the server
        assert await gen.puller(task_spec(gen, "math", ack_wait=1.0, max_deliver=2), Task.decode).fetch(
            1, timeout=2.0) == []  # give up on it and emit the advisory
        (dl,) = await dead_letters(gen, 1, timeout=30)
        assert dl.reason == "max_deliveries" and dl.data == raw
        assert await _advisory_deliveries(gen, "TASKS", "generator_math") >= 1
        assert await _advisory_deliveries(rew, "ROLLOUTS", "reward") == 0
        assert LEGACY_ADVISORY_DURABLE not in {c.name for c in await gen.connection.js.consumers_info(s.advisory_stream)}
    finally:
        await gen.close()
        await rew.close()


async def test_a_run_with_the_shared_advisory_durable_migrates_and_keeps_its_advisories(nats_server, run_name):
    """A run made before the split has one unfiltered advisory durable; the first per-durable
    declaration removes it, and an advisory it had not acked is still dead-lettered."""
    from rlbus.bus.jetstream import JetStreamBus
    from rlbus.bus.streams import ensure_streams

    b = await JetStreamBus.connect(nats_server.url, run_name, name="old", **BUS_TEST_OPTIONS)
    try:
        s, js = b.subjects, b.connection.js
        await ensure_streams(js, s)
        await js.add_consumer(s.advisory_stream, api.ConsumerConfig(
            durable_name=LEGACY_ADVISORY_DURABLE, ack_policy=api.AckPolicy.EXPLICIT, max_deliver=-1))
        raw = Task(run="r", task_id="old", pool="math", env="addition", prompt="1+1=").encode()
        ack = await js.publish(s.tasks("math"), raw)
        advisory = {"stream": s.stream("TASKS"), "consumer": "generator_math", "stream_seq": ack.seq,
                    "deliveries": 3}
        await js.publish(s.max_deliveries_advisory("TASKS", "generator_math"), json.dumps(advisory).encode())
    finally:
        await b.close()

    new = await JetStreamBus.connect(nats_server.url, run_name, name="new", **BUS_TEST_OPTIONS)
    try:
        await new.puller(task_spec(new, "math"), Task.decode).fetch(1, timeout=0.2)  # declares the durable
        (dl,) = await dead_letters(new, 1, timeout=30)
        assert dl.reason == "max_deliveries" and dl.data == raw
        names = {c.name for c in await new.connection.js.consumers_info(new.subjects.advisory_stream)}
        assert LEGACY_ADVISORY_DURABLE not in names and new.subjects.advisory_durable("TASKS", "generator_math") in names
    finally:
        await new.close()
