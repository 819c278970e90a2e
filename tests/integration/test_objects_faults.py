"""Object names the store cannot address, on a real server: refused with ``BadObjectName`` (a
``BusError``) before any request, and the connection stays usable.  Found by fuzzing: ``get("")``
raised nats-py's own ``NoRespondersError``, and a 3,000-character name made the server close the
client's connection for good ("maximum control line exceeded"), so the service died on its next call."""

from __future__ import annotations

import pytest

from rlbus.bus import BadObjectName, BusError
from rlbus.bus.protocol import MAX_OBJECT_NAME_BYTES as MAX_NAME_BYTES
from rlbus.bus.protocol import ObjectNotFound

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

BAD_NAMES = {
    "empty": "",
    "control_line": "w" * 3000,
    "over_limit": "é" * (MAX_NAME_BYTES // 2 + 1),  # 513 characters, 1026 bytes
    "nul": "weights/v1\x00/model.safetensors",
    "lone_surrogate": "weights/\ud800",
}


@pytest.mark.parametrize("label", sorted(BAD_NAMES))
async def test_a_bad_object_name_is_refused_and_the_connection_survives(bus, label):
    name = BAD_NAMES[label]
    for op in (lambda: bus.objects.get(name), lambda: bus.objects.put(name, b"bytes"),
               lambda: bus.objects.delete(name), lambda: bus.objects.info(name)):
        with pytest.raises(BadObjectName) as caught:
            await op()
        assert isinstance(caught.value, BusError)
        assert "object name" in str(caught.value) and "use a non-empty name" in str(caught.value)
    # The same connection still reads, writes and publishes.
    await bus.objects.put("weights/after", b"still here")
    assert await bus.objects.get("weights/after") == b"still here"
    with pytest.raises(ObjectNotFound):
        await bus.objects.get("weights/never-written")
    await bus.publish(bus.subjects.metrics("trainer", "t0"), b"x", msg_id=f"after-{label}")


async def test_a_name_at_the_limit_round_trips(bus):
    name = "w/" + "a" * (MAX_NAME_BYTES - 2)
    await bus.objects.put(name, b"at the limit")
    assert await bus.objects.get(name) == b"at the limit"
    assert [o.name for o in await bus.objects.list()] == [name]
    await bus.objects.delete(name)
    with pytest.raises(ObjectNotFound):
        await bus.objects.get(name)


async def test_a_valid_upload_outlives_a_burst_of_forged_ones_and_is_published(bus, run_name, tmp_path):
    """F11 + F6 on a real server: uploads published before weight-broadcast reads any of them are all
    kept (the WEIGHTS per-subject limit once discarded the oldest past 8), each forged one is refused
    on its first delivery, and the valid one is published."""
    import hashlib

    from rlbus.schemas import DeadLetter, Shard, WeightManifest
    from tests.integration.helpers import broadcast_running, dead_letters, eventually

    s = bus.subjects
    data = b"safetensors bytes of v1"
    info = await bus.objects.put("weights/policy/v1/model.safetensors", data)
    good = WeightManifest(model="policy", version=1, transport="objstore", state="uploaded",
                          shards=[Shard(name="model.safetensors", sha256=info.sha256, size=info.size,
                                        location="weights/policy/v1/model.safetensors")])
    forged = [WeightManifest(model="policy", version=v, transport="objstore", state="uploaded",
                             shards=[Shard(name="x", sha256=hashlib.sha256(b"%d" % v).hexdigest(), size=1,
                                           location=f"weights/policy/forged{v}")]) for v in range(2, 22)]
    # The valid upload first, then more forged ones than the old per-subject limit kept.
    await bus.publish_many([(s.weight_uploads("policy"), m.encode(), f"{m.msg_id}.{i}")
                            for i, m in enumerate([good, *forged])])
    async with broadcast_running(bus, run_name, tmp_path) as service:
        await eventually(lambda: service.b.latest == 1 and service.b.refused == len(forged), timeout=60)
    assert WeightManifest.decode(await bus.last(s.weights("policy"))).version == 1
    letters: list[DeadLetter] = await dead_letters(bus, len(forged), timeout=30)
    assert all(d.deliveries == 1 and "is missing" in d.reason for d in letters), letters[0]
    # Forged versions above the valid one were refused, never published.
    assert service.b.latest == 1
