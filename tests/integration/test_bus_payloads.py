"""Big payloads on a real server: claim check for a 20 MB rollout, object store round trips."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

import numpy as np
import pytest

from rlbus.bus.protocol import ConsumerSpec, Delivery, DigestMismatch, ObjectNotFound
from rlbus.schemas import Rollout, RolloutGroup, Task, spans_from_versions
from tests.integration.helpers import consuming, eventually, stream_messages

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def big_group(n_tokens: int) -> RolloutGroup:
    rng = np.random.default_rng(0)
    prompt_len = 16
    completion = n_tokens - prompt_len
    versions = np.repeat(np.arange(4), completion // 4 + 1)[:completion]
    rollout = Rollout(
        rollout_id="r0", task_id="t-big", index=0,
        token_ids=rng.integers(0, 150_000, n_tokens, dtype=np.int64).astype("<i4"), prompt_len=prompt_len,
        loss_mask=np.ones(completion, dtype="|u1"),
        behaviour_logprobs=-rng.random(completion, dtype=np.float32).astype("<f4"),
        version_spans=spans_from_versions(versions),
    )
    task = Task(run="r", task_id="t-big", pool="math", env="addition", prompt="long")
    return RolloutGroup(task=task, rollouts=[rollout])


async def test_claim_check_round_trips_a_20mb_rollout(bus):
    s = bus.subjects
    group = big_group(2_300_000)  # 4 + 1 + 4 bytes per completion token: ~20.7 MB encoded
    raw = group.encode()
    assert len(raw) > 20_000_000 > bus.claim_threshold
    await bus.publish(s.rollouts("math"), raw, msg_id="rollouts.t-big")
    got: list[RolloutGroup] = []

    async def handler(g: RolloutGroup, d: Delivery[RolloutGroup]) -> None:
        assert "Rlbus-Claim" not in d.headers  # transparent to the service
        got.append(g)

    spec = ConsumerSpec(stream="ROLLOUTS", durable="reward", filter_subjects=(s.all_of("rollouts"),))
    async with consuming(bus, spec, RolloutGroup.decode, handler):
        await eventually(lambda: got, timeout=20)
    (r,) = got[0].rollouts
    want = group.rollouts[0]
    assert np.array_equal(r.token_ids, want.token_ids)
    assert np.array_equal(r.behaviour_logprobs, want.behaviour_logprobs)
    assert np.array_equal(r.version_spans, want.version_spans)
    await eventually(lambda: _gone(bus, "ROLLOUTS"))
    # The claimed bytes go once the work-queue message is acked.
    await eventually(lambda: _no_claims(bus), timeout=5)


async def _gone(bus, kind: str) -> bool:
    return await stream_messages(bus, kind) == 0


async def _no_claims(bus) -> bool:
    return not [o for o in await bus.objects.list() if o.name.startswith("claims/")]


async def test_claimed_payload_is_resolved_by_last_and_watch(bus):
    s = bus.subjects
    blob = os.urandom(bus.claim_threshold + 1024)
    await bus.publish(s.weights("policy"), blob, msg_id="w1")
    assert await bus.last(s.weights("policy")) == blob
    w = bus.watch(s.weights("policy"), deliver="last_per_subject")
    async with asyncio.timeout(10):
        d = await w.__anext__()
    await w.aclose()
    assert d.msg == blob and "Rlbus-Claim" not in d.headers


async def test_object_store_50mb_round_trip_with_digest(bus):
    data = os.urandom(50 * 1024 * 1024)
    info = await bus.objects.put("weights/v1/shard0", data)
    assert info.size == len(data)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert await bus.objects.get("weights/v1/shard0") == data
    assert [o.name for o in await bus.objects.list()] == ["weights/v1/shard0"]
    # Overwrite replaces the bytes and frees the old chunks.
    small = b"v2" * 1000
    await bus.objects.put("weights/v1/shard0", small)
    assert await bus.objects.get("weights/v1/shard0") == small
    await bus.objects.delete("weights/v1/shard0")
    await bus.objects.delete("weights/v1/shard0")  # idempotent
    with pytest.raises(ObjectNotFound):
        await bus.objects.get("weights/v1/shard0")


async def test_object_store_refuses_bytes_that_do_not_match_the_digest(bus):
    data = os.urandom(3 * 1024 * 1024 + 17)
    await bus.objects.put("weights/v2/shard0", data)
    # Corrupt the recorded digest the way a torn or tampered write would look to a reader.
    store = bus.objects
    meta_subject = f"$O.{store.bucket}.M." + __import__("base64").urlsafe_b64encode(b"weights/v2/shard0").decode()
    raw = await bus.connection.js.get_last_msg(store.stream, meta_subject)
    meta = json.loads(raw.data)
    wrong = hashlib.sha256(b"something else").digest()
    meta["digest"] = "SHA-256=" + __import__("base64").urlsafe_b64encode(wrong).decode()
    await bus.connection.js.publish(meta_subject, json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
    with pytest.raises(DigestMismatch) as err:
        await store.get("weights/v2/shard0")
    assert err.value.name == "weights/v2/shard0"
    assert err.value.expected == wrong.hex()
    assert err.value.actual == hashlib.sha256(data).hexdigest()
    assert "weights/v2/shard0" in str(err.value) and wrong.hex() in str(err.value)


async def test_empty_object(bus):
    await bus.objects.put("empty", b"")
    assert await bus.objects.get("empty") == b""
