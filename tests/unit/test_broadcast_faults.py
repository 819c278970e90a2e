"""weight-broadcast on the in-memory bus, against what a fuzz run sent it: an upload whose shard is
missing or unaddressable is refused at once (DEAD on its first delivery, with the reason), not
retried until max_deliver while real uploads wait behind it; a transient error is retried; a
restart past an undecodable newest manifest resumes from the newest readable one.  One broadcast
serves the policy and its draft (``<model>-draft``): separate numbering, retention per model,
held-out rounds pin only the policy."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from typing import Any

from rlbus.bus.memory import MemoryBus
from rlbus.bus.protocol import ServerUnavailable
from rlbus.schemas import Control, Evaluate, Heartbeat, SchemaError, Shard, WeightManifest
from rlbus.schemas.metric_keys import DraftKeys
from rlbus.services.broadcast.service import Broadcaster, BroadcastService
from rlbus.services.broadcast.settings import BroadcastSettings
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.runtime.weights import ObjectStoreTransport
from tests.running import workers_running

RUN = "r"


async def eventually(predicate: Callable[[], Any], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within the deadline")
        await asyncio.sleep(0.01)


class FlakyTransport(ObjectStoreTransport):
    """Fails the first ``failures`` reads as a server outage would."""

    def __init__(self, bus: MemoryBus, failures: int) -> None:
        super().__init__(bus)
        self.failures = failures

    async def read(self, shard: Shard) -> bytes:
        if self.failures:
            self.failures -= 1
            raise ServerUnavailable("the server did not answer (test)")
        return await super().read(shard)


def upload(version: int, location: str, sha256: str) -> WeightManifest:
    return WeightManifest(model="policy", version=version, transport="objstore", state="uploaded",
                          shards=[Shard(name="model.safetensors", sha256=sha256, size=1, location=location)])


async def real_upload(bus: MemoryBus, version: int) -> WeightManifest:
    location = f"weights/policy/v{version}/model.safetensors"
    info = await bus.objects.put(location, f"weights of v{version}".encode())
    return upload(version, location, info.sha256)


def forged(version: int, location: str | None = None) -> WeightManifest:
    return upload(version, location if location is not None else f"weights/policy/forged{version}",
                  hashlib.sha256(b"%d" % version).hexdigest())


@contextlib.asynccontextmanager
async def broadcasting(bus: MemoryBus, transport: Any = None):  # type: ignore[no-untyped-def]
    cfg = BroadcastSettings()
    life = Lifecycle(grace=1.0)
    service = BroadcastService(RunSettings(run=RUN), cfg, bus=bus, life=life,
                               broadcaster=Broadcaster(transport or ObjectStoreTransport(bus), cfg))
    await service.resume()
    async with workers_running(life, service, timeout=20):
        yield service


async def send(bus: MemoryBus, *uploads: WeightManifest) -> None:
    for i, m in enumerate(uploads):
        await bus.publish(bus.subjects.weight_uploads("policy"), m.encode(), msg_id=f"{m.msg_id}.{i}")


def published(bus: MemoryBus) -> list[int]:
    """Versions announced on the manifest subject (skipping what the tests forged there)."""
    out = []
    for s, d in bus.messages("WEIGHTS"):
        if s == bus.subjects.weights("policy"):
            with contextlib.suppress(SchemaError):
                out.append(WeightManifest.decode(d).version)
    return out


async def test_an_upload_whose_shard_is_missing_is_refused_on_its_first_delivery() -> None:
    bus = MemoryBus(RUN, error_backoff=(0.5, 0.5))  # a retry would show as a second delivery
    async with broadcasting(bus) as service:
        await send(bus, *[forged(v) for v in range(2, 8)], await real_upload(bus, 8))
        await eventually(lambda: published(bus) == [8] and len(bus.dead_letters) == 6)
    assert service.b.refused == 6
    for letter in bus.dead_letters:
        assert letter.deliveries == 1, letter
        assert "is missing" in letter.reason and "ObjectNotFound" in letter.reason, letter.reason
        assert letter.error == "Poison"


async def test_an_upload_naming_an_unaddressable_object_is_refused_at_once() -> None:
    bus = MemoryBus(RUN, error_backoff=(0.5, 0.5))
    async with broadcasting(bus):  # MemoryBus's store refuses the names the real one does
        await send(bus, forged(2, ""), forged(3, "w" * 3000), await real_upload(bus, 4))
        await eventually(lambda: published(bus) == [4] and len(bus.dead_letters) == 2)
    assert all(d.deliveries == 1 and "BadObjectName" in d.reason for d in bus.dead_letters)


async def test_a_transient_read_error_is_retried_and_the_version_published() -> None:
    bus = MemoryBus(RUN, error_backoff=(0.01, 0.01))
    async with broadcasting(bus, FlakyTransport(bus, failures=1)):
        await send(bus, await real_upload(bus, 1))
        await eventually(lambda: published(bus) == [1])
    assert bus.dead_letters == []


async def test_a_restart_skips_an_undecodable_newest_manifest() -> None:
    bus = MemoryBus(RUN)
    subject = bus.subjects.weights("policy")
    for v in (1, 2):
        m = await real_upload(bus, v)
        pub = WeightManifest(model="policy", version=v, transport="objstore", shards=m.shards, state="published")
        await bus.publish(subject, pub.encode(), msg_id=pub.msg_id)
    await bus.publish(subject, b"\xc1 not a manifest", msg_id="forged")
    async with broadcasting(bus) as service:
        assert service.b.latest == 2
        # An upload at or below the resumed version is a duplicate; the next one is published.
        await send(bus, await real_upload(bus, 2), await real_upload(bus, 3))
        await eventually(lambda: published(bus)[-1:] == [3])


async def test_a_restart_with_only_an_undecodable_manifest_starts_from_none() -> None:
    bus = MemoryBus(RUN)
    await bus.publish(bus.subjects.weights("policy"), b"\xc1", msg_id="forged")
    async with broadcasting(bus) as service:
        assert service.b.latest == -1
        await send(bus, await real_upload(bus, 1))
        await eventually(lambda: service.b.latest == 1)


async def test_a_generator_refuses_a_published_version_naming_an_unaddressable_object(tmp_path: Any) -> None:
    """The weight follower's side of the same check: a manifest whose shard names no addressable
    object is refused (dead-lettered, sampling goes on), not skipped as deleted and not fatal."""
    from tests.unit.test_generator_intake import Harness
    from tests.unit.test_generator_intake import eventually as gen_eventually

    async with Harness(tmp_path) as h:
        for version, location in ((1, ""), (2, "w" * 3000)):
            m = WeightManifest(model="policy", version=version, transport="objstore",
                               shards=[Shard(name="model.safetensors", sha256="0" * 64, size=1, location=location)])
            await h.bus.publish(h.s.weights("policy"), m.encode(), msg_id=m.msg_id)
        await gen_eventually(lambda: len(h.bus.dead_letters) == 2, what="both versions refused")
        assert all(d.reason == "weights_refused" and "BadObjectName" in d.error for d in h.bus.dead_letters)
        assert h.metric("generator/weights_skipped") in (0, None)
        assert not h.task.done()  # type: ignore[union-attr]


# --- one broadcast, two models: the policy and its draft ---------------------------------------------

def draft_upload(version: int, location: str, sha256: str, model: str = "policy-draft") -> WeightManifest:
    return WeightManifest(model=model, version=version, transport="objstore", state="uploaded", policy_version=version + 10,
                          shards=[Shard(name="model.safetensors", sha256=sha256, size=1, location=location)])


async def test_draft_uploads_are_announced_under_the_draft_name_with_their_own_numbering() -> None:
    bus = MemoryBus(RUN, error_backoff=(0.5, 0.5))
    async with broadcasting(bus) as service:
        await send(bus, await real_upload(bus, 5))
        for v in (1, 2):
            info = await bus.objects.put(f"weights/policy-draft/v{v}/model.safetensors", b"draft %d" % v)
            m = draft_upload(v, f"weights/policy-draft/v{v}/model.safetensors", info.sha256)
            await bus.publish(bus.subjects.weight_uploads("policy-draft"), m.encode(), msg_id=m.msg_id)
        # An upload naming another model on the draft's subject is refused at once.
        wrong = draft_upload(3, "weights/policy-draft/v2/model.safetensors", info.sha256, model="policy")
        await bus.publish(bus.subjects.weight_uploads("policy-draft"), wrong.encode(), msg_id="wrong")
        drafts = lambda: [WeightManifest.decode(d) for s, d in bus.messages("WEIGHTS")  # noqa: E731
                          if s == bus.subjects.weights("policy-draft")]
        await eventually(lambda: len(drafts()) == 2 and published(bus) == [5] and len(bus.dead_letters) == 1)
        metrics = service.beat.extra() if service.beat.extra else {}
    assert [(m.version, m.policy_version, m.state) for m in drafts()] == [(1, 11, "published"), (2, 12, "published")]
    assert "names model 'policy'" in bus.dead_letters[0].reason
    # Two lanes, two numberings: the draft's versions 1, 2 were not "duplicates" of the policy's 5.
    assert service.b.latest == 5 and service.draft.latest == 2
    assert metrics["broadcast/latest"] == 5 and metrics["broadcast/draft/latest"] == 2


def test_retention_is_per_model_and_only_the_policy_is_pinned_by_held_out_rounds() -> None:
    cfg = BroadcastSettings(keep_versions=1, keep_eval_versions=2)
    transport = ObjectStoreTransport(MemoryBus(RUN))
    policy = Broadcaster(transport, cfg, model="policy")
    draft = Broadcaster(transport, cfg, model="policy-draft", role="draft")
    for b in (policy, draft):
        for v in range(1, 6):
            b.mark_published(upload(v, f"weights/x/v{v}", "0" * 64))
    evaluate = Control(seq=1, decision=Evaluate(version=2, tasks=10), target_service="generator")
    hb = Heartbeat(service="generator", instance="gen-0", seq=1, ts=time.time(), version=4,
                   metrics={DraftKeys.VERSION: 3.0})
    for b in (policy, draft):
        b.note_evaluation(evaluate)
        b.note_generator(hb)
    assert policy.deletable() == [1, 3]  # 2 pinned by the held-out round, 4 in use, 5 the newest
    assert draft.deletable() == [1, 2, 4]  # 3 in use as the generator's draft, 5 the newest; no pin
