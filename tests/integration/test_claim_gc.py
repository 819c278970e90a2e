"""The claim collector on a real server: claims of messages a limits stream dropped are deleted,
claims any held message can still reference are kept (``rlbus.bus.claims``)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rlbus.bus.claims import CLAIM_PREFIX, ClaimCollector, ClaimFloors
from rlbus.bus.jetstream import JetStreamBus
from rlbus.bus.protocol import ServerUnavailable
from rlbus.bus.retention import Retention
from rlbus.services.broadcast.service import Broadcaster, BroadcastService, ClaimSweeper
from rlbus.services.broadcast.settings import BroadcastSettings
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.runtime.weights import ObjectStoreTransport
from tests.conftest import BUS_TEST_OPTIONS
from tests.integration.helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

THRESHOLD = 4096  # every payload below is claim-checked
SCORED_CAP = 3
# The collector's margin stands in for the publish deadline plus outage budget: it must exceed the
# time from a claim's put to its message's store (milliseconds here, more on a loaded machine).
MARGIN = 1.0
AGE = 2.0  # how much older than the newer messages the old ones are made


@pytest.fixture
async def small(nats_server: Any, run_name: str) -> AsyncIterator[JetStreamBus]:
    """A bus whose SCORED keeps the newest ``SCORED_CAP`` groups and claims anything over 4 KiB."""
    b = await JetStreamBus.connect(nats_server.url, run_name, name="claims", claim_threshold=THRESHOLD,
                                   retention=Retention(scored_max_msgs=SCORED_CAP), **BUS_TEST_OPTIONS)
    try:
        yield b
    finally:
        await b.close()


def payload(tag: str) -> bytes:
    return tag.encode() + os.urandom(2 * THRESHOLD)


async def claims(bus: JetStreamBus) -> dict[str, Any]:
    return {e.name: e for e in await bus.objects.stored(CLAIM_PREFIX) if not e.deleted}


async def held(bus: JetStreamBus, subject: str, n: int) -> list[bytes]:
    """What a replay of ``subject`` reads now (claims resolved)."""
    out: list[bytes] = []
    w = bus.watch(subject, deliver="all")
    try:
        async with asyncio.timeout(10):
            while len(out) < n:
                out.append((await w.__anext__()).msg)
    finally:
        await w.aclose()
    return out


async def test_claims_of_dropped_groups_are_collected_and_held_ones_resolve(small: JetStreamBus) -> None:
    s = small.subjects
    # Published early and still held by their own streams: a task nobody took yet, a dead letter.
    task = payload("task")
    await small.publish(s.tasks("math"), task, msg_id="task-0")
    await small.dead_letter(s.tasks("math"), payload("bad"), error="test", reason="schema_error")
    old = [payload(f"old{i}") for i in range(SCORED_CAP)]
    for i, data in enumerate(old):
        await small.publish(s.scored("math"), data, msg_id=f"old-{i}")
    await asyncio.sleep(AGE)
    new = [payload(f"new{i}") for i in range(SCORED_CAP)]
    for i, data in enumerate(new):
        await small.publish(s.scored("math"), data, msg_id=f"new-{i}")  # drops old-0 .. old-2
    before = await claims(small)
    assert {f"claims/SCORED/old-{i}" for i in range(SCORED_CAP)} <= set(before)

    result = await small.collect_claims(margin=MARGIN)

    after = await claims(small)
    assert result.collected == SCORED_CAP
    assert not [n for n in after if n.startswith("claims/SCORED/old-")]
    # new-0's claim was stored before the oldest held message (new-0 itself) and is kept all the same.
    assert {f"claims/SCORED/new-{i}" for i in range(SCORED_CAP)} <= set(after)
    assert "claims/TASKS/task-0" in after and any(n.startswith("claims/DEAD/") for n in after)
    assert result.kept == len(after)
    assert await held(small, s.all_of("scored"), SCORED_CAP) == new
    assert await small.last(s.tasks("math")) == task
    # A second pass finds nothing more to do.
    again = await small.collect_claims(margin=MARGIN)
    assert (again.collected, again.kept) == (0, len(after))


async def test_a_claim_whose_message_is_still_being_published_is_kept(small: JetStreamBus) -> None:
    s = small.subjects
    for i in range(SCORED_CAP):
        await small.publish(s.scored("math"), payload(f"old{i}"), msg_id=f"old-{i}")
    await asyncio.sleep(AGE)
    # A publish that stored its claim and is waiting out the server (here: held back) before its message.
    go = asyncio.Event()
    publisher = small.connection.publisher
    plain_retry = publisher._retry

    async def held_back(subject: str, data: bytes, hdrs: dict[str, str], clock: Any) -> None:
        if hdrs.get("Nats-Msg-Id") == "late":
            await go.wait()
        await plain_retry(subject, data, hdrs, clock)

    publisher._retry = held_back
    late = payload("late")
    sending = asyncio.create_task(small.publish(s.scored("late"), late, msg_id="late"))
    try:
        await eventually(lambda: _has(small, "claims/SCORED/late"))
        await asyncio.sleep(0.3)
        for i in range(SCORED_CAP):
            await small.publish(s.scored("math"), payload(f"new{i}"), msg_id=f"new-{i}")
        # Now the late claim is older than every message SCORED holds: only the margin keeps it.
        collector: ClaimCollector = small.connection.claim_collector
        floors = ClaimFloors(await collector.stream_times())
        entry = (await claims(small))["claims/SCORED/late"]
        assert ClaimCollector.unreachable(entry, floors, 0.0)
        result = await small.collect_claims(margin=MARGIN)
        assert result.collected == SCORED_CAP  # the old groups' claims went in the same pass
        assert "claims/SCORED/late" in await claims(small)
    finally:
        go.set()
        await sending
    assert await small.last(s.scored("late")) == late


async def _has(bus: JetStreamBus, name: str) -> bool:
    return name in await claims(bus)


async def test_leftover_claims_markers_and_half_collected_ones_of_an_emptied_work_queue_go(small: JetStreamBus) -> None:
    s = small.subjects
    # A release that never happened (the service died between ack and delete) and one that did.
    await small.objects.put("claims/ROLLOUTS/leaked", payload("leaked"))
    await small.objects.put("claims/ROLLOUTS/released", payload("released"))
    await small.objects.delete("claims/ROLLOUTS/released")
    # A collection cut short by a kill: the chunks went, the record stayed; the next pass finishes it.
    await small.objects.put("claims/ROLLOUTS/cut", payload("cut"))
    (cut,) = await small.objects.stored("claims/ROLLOUTS/cut")
    await small.objects.purge_chunks(cut.nuid)
    await asyncio.sleep(AGE)
    await small.publish(s.metrics("test", "t0"), b"heartbeat", msg_id="hb-0")  # the server's clock moves on
    result = await small.collect_claims(margin=MARGIN)
    assert (result.collected, result.markers, result.orphans) == (2, 1, 0)
    assert await small.objects.stored(CLAIM_PREFIX) == []  # no record left, not even a marker


async def test_forget_keeps_a_copy_written_since(small: JetStreamBus) -> None:
    name = "claims/SCORED/rewritten"
    await small.objects.put(name, b"first" * 2000)
    (seen,) = await small.objects.stored(name)
    await small.objects.put(name, b"second" * 2000)  # a retried publish re-writes its claim
    await small.objects.forget(seen)
    assert await small.objects.get(name) == b"second" * 2000


async def test_an_old_name_without_its_stream_waits_for_every_stream(small: JetStreamBus) -> None:
    s = small.subjects
    await small.objects.put("claims/legacy-id", payload("legacy"))
    await small.publish(s.control("generator"), b"decision", msg_id="ctl-0")  # CONTROL keeps it for good
    await small.publish(s.scored("math"), payload("g0"), msg_id="g-0")
    await asyncio.sleep(AGE)
    for i in range(1, SCORED_CAP + 1):
        await small.publish(s.scored("math"), payload(f"g{i}"), msg_id=f"g-{i}")  # drops g-0
    result = await small.collect_claims(margin=MARGIN)
    # SCORED dropped a group, but the name does not say which stream its message is on.
    assert "claims/legacy-id" in await claims(small)
    assert result.collected == 1  # g-0's claim, judged against SCORED alone


async def test_weight_broadcast_collects_on_its_loop_and_counts_on_its_heartbeat(small: JetStreamBus) -> None:
    s = small.subjects
    for i in range(SCORED_CAP):
        await small.publish(s.scored("math"), payload(f"old{i}"), msg_id=f"old-{i}")
    await asyncio.sleep(AGE)
    for i in range(SCORED_CAP):
        await small.publish(s.scored("math"), payload(f"new{i}"), msg_id=f"new-{i}")
    cfg = BroadcastSettings()
    service = BroadcastService(RunSettings(run=s.run), cfg, bus=small, life=Lifecycle(grace=1.0),
                               broadcaster=Broadcaster(ObjectStoreTransport(small), cfg),
                               claims=ClaimSweeper(small, every=0.2, margin=MARGIN))
    assert service.claims.loop in service.workers()
    sweeping = asyncio.create_task(service.claims.loop())
    try:
        await eventually(lambda: service.beat.extra()["broadcast/claims_collected"] == SCORED_CAP)  # type: ignore[misc]
    finally:
        sweeping.cancel()
    beat = service.beat.extra()  # type: ignore[misc]
    assert beat["broadcast/claims_kept"] == SCORED_CAP and beat["broadcast/claim_collection_failures"] == 0


class UnreachableBus:
    async def collect_claims(self, *, margin: float | None = None) -> None:
        raise ServerUnavailable("the server did not answer (test)")


async def test_a_failed_collection_is_counted_and_does_not_stop_the_service() -> None:
    sweeper = ClaimSweeper(UnreachableBus(), every=0.01)  # type: ignore[arg-type]
    await sweeper.once()
    await sweeper.once()
    assert sweeper.metrics()["broadcast/claim_collection_failures"] == 2


async def test_chunks_a_cut_short_put_left_go_and_a_put_in_progress_keeps_its_own(small: JetStreamBus) -> None:
    s, objects = small.subjects, small.objects
    js = small.connection.js
    await objects.put("weights/policy/v1/model.safetensors", b"w" * 3000)
    # A put killed after its first chunks: chunks on a subject no metadata record names.
    await js.publish(f"$O.{objects.bucket}.C.killedput", b"partial chunk")
    await asyncio.sleep(AGE)
    # A put still writing its chunks: as unnamed, but written just now.
    await js.publish(f"$O.{objects.bucket}.C.inprogress", b"first chunk")
    await small.publish(s.metrics("test", "t0"), b"heartbeat", msg_id="hb-0")
    result = await small.collect_claims(margin=MARGIN)
    assert result.orphans == 1
    assert sorted(await objects.chunk_sets()) == sorted(
        ["inprogress", *(e.nuid for e in await objects.stored())])
    assert await objects.get("weights/policy/v1/model.safetensors") == b"w" * 3000
