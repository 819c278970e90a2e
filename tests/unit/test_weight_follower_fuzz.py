"""10,000 forged weight manifests through the generator's weight follower, each accounted for.

The real-process fuzz (tests/e2e/test_fuzz.py) can only pace a few hundred manifests onto WEIGHTS:
the stream keeps the last 1,024 per subject, so a larger burst could discard a forged manifest
before a generator read it, and the test could not tell that from a lost one.  Here the same
10,000 cases (tests/e2e/fuzz.py, target ``weights``) go through ``WeightFollower.on_manifest`` of a
real ``Generator`` on the in-memory bus (the real decoder and weight transports, every delivery
from a watch), one at a time, and each must end in exactly one way:

- refused with its reason: in DEAD with the same bytes (undecodable, unreadable, a digest that
  does not match, a file outside the run), shown on the heartbeat when it named a version;
- skipped: a newer version whose bytes are not there (what retention deleting them looks like),
  counted on the heartbeat;
- passed over: a version no newer than the live one, which the generator already has.

No forged version is ever staged, the follower never raises, and genuine versions published
amid the fuzz are staged as usual.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

from rlbus.bus.memory import MemoryBus
from rlbus.bus.protocol import BusError
from rlbus.bus.subjects import Subjects
from rlbus.schemas import Shard, WeightManifest
from rlbus.services.generator.core import Generator
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.generator.status import Status
from rlbus.services.generator.weight_follower import WeightFollower
from rlbus.services.runtime.heartbeat import Beat
from tests.e2e import fuzz
from tests.unit.test_generator_intake import FakeBackend

N = 10_000


def _genuine(version: int, data: bytes) -> WeightManifest:
    return WeightManifest(model=fuzz.MODEL, version=version, transport="objstore", state="published",
                          shards=[Shard(name="model.safetensors", sha256=hashlib.sha256(data).hexdigest(),
                                        size=len(data), location=f"weights/genuine-v{version}/model.safetensors")])


async def _plant_forged_bytes(bus: MemoryBus, cases: list[fuzz.Case]) -> None:
    """Bytes at the location a third of the decodable cases name, so their digests are checked
    (and fail) instead of the read finding nothing."""
    for c in cases:
        if c.decodes and c.index % 3 == 0:
            m = WeightManifest.decode(c.data)
            if m.transport == "objstore":
                try:
                    await bus.objects.put(m.shards[0].location, b"forged " + c.uid.encode())
                except (BusError, ValueError):
                    pass  # a key the store refuses: the follower's read is refused the same way


async def test_10k_forged_manifests_are_each_refused_skipped_or_passed_over(tmp_path: Path) -> None:
    run = fuzz.RUN
    bus = MemoryBus(run)
    s = Subjects(run)
    subject = s.weights(fuzz.MODEL)
    backend = FakeBackend()
    gen = Generator(backend, GeneratorSettings(instance="gen-0"), [fuzz.POOL])  # type: ignore[arg-type]
    status = Status(Beat(bus, s, "generator", "gen-0", period=60.0), gen)
    follower = WeightFollower(bus, subject, gen, status, run_dir=str(tmp_path))

    cases = list(fuzz.cases("weights", N, s))
    await _plant_forged_bytes(bus, cases)
    genuine = {N // 2: (_genuine(1, b"genuine v1"), b"genuine v1"), N: (_genuine(2, b"genuine v2"), b"genuine v2")}
    stream: list[fuzz.Case | WeightManifest] = []
    for i, c in enumerate(cases):
        if i in genuine:
            stream.append(genuine[i][0])
        stream.append(c)
    stream.append(genuine[N][0])
    for m, data in genuine.values():
        await bus.objects.put(m.shards[0].location, data)
    for item in stream:
        if isinstance(item, WeightManifest):
            await bus.publish(subject, item.encode(), msg_id=f"weights.genuine.{item.version}")
        else:
            await bus.publish(subject, item.data, msg_id=item.msg_id)

    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    watch = bus.watch(subject, deliver="all")
    deliveries = aiter(watch)
    for item in stream:
        d = await anext(deliveries)
        before = (gen.dead, gen.weights_skipped, gen.weights_refused, len(backend.staged))
        live = backend.version
        await follower.on_manifest(d)  # raising here fails the test: it would kill the generator
        dead, skipped, refused, staged = (gen.dead - before[0], gen.weights_skipped - before[1],
                                          gen.weights_refused - before[2], len(backend.staged) - before[3])
        if isinstance(item, WeightManifest):  # genuine: staged, swapped in and shown on the heartbeat at once
            if (dead, skipped, staged) != (0, 0, 1) or backend.staged[-1][0] != item.version:
                problems.append(f"genuine v{item.version} not staged: dead={dead} skipped={skipped}")
            if backend.version != item.version or status.beat.version != item.version:
                problems.append(f"genuine v{item.version} not live at once: backend v{backend.version}, "
                                f"heartbeat v{status.beat.version}")
            outcomes["genuine_staged"] += 1
            continue
        where = f"{item.msg_id} {item.kind}"
        if staged:
            problems.append(f"a forged manifest was staged: {where}")
        if dead + skipped > 1:
            problems.append(f"counted twice: dead={dead} skipped={skipped}: {where}")
        if dead:
            # DEAD keeps one letter per (subject, reason, error, bytes): a repeat of the same
            # forged bytes finds its letter already there.
            letters = [x for x in bus.dead_letters if x.data == item.data and x.origin_subject == subject]
            if not letters or not all(x.reason and x.error for x in letters):
                problems.append(f"refused but not in DEAD with its bytes and a reason: {where}")
            if item.decodes and refused != 1:
                problems.append(f"refused version not shown on the heartbeat: {where}")
            outcomes["refused" if item.decodes else "refused_undecodable"] += 1
        elif skipped:
            outcomes["skipped_not_there"] += 1
        elif not item.decodes:
            problems.append(f"undecodable manifest not refused: {where}")
        else:
            version = WeightManifest.decode(item.data).version
            if version > live:
                problems.append(f"newer version v{version} neither staged, skipped nor refused: {where}")
            outcomes["passed_over_not_newer"] += 1
    await watch.aclose()

    print(f"\n{N} forged manifests through the weight follower: {dict(outcomes)}")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:20])
    assert sum(outcomes.values()) == N + len(genuine)
    assert backend.version == 2 and outcomes["genuine_staged"] == 2
    # Every way to end was taken, so none of the checks above held vacuously.
    assert all(outcomes[k] > 0 for k in ("refused_undecodable", "refused", "skipped_not_there",
                                         "passed_over_not_newer")), outcomes
    assert gen.metrics()["generator/weights_skipped"] == outcomes["skipped_not_there"]
    assert gen.dead == outcomes["refused_undecodable"] + outcomes["refused"]
    await bus.close()
