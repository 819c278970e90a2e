"""On a real nats-server: the speculator reads SCORED through a durable of its own (the trainer's
still sees every group), dead-letters what it cannot decode or train on and goes on, and its draft
versions come out of weight-broadcast on ``weights.<model>-draft`` with the policy version they
were distilled on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.bus.protocol import ConsumerSpec
from rlbus.bus.subjects import draft_model_name
from rlbus.schemas import ScoredGroup, WeightManifest
from rlbus.services.policy.draft_model import build_draft, save_draft
from rlbus.services.policy.tokenizer import build_char_tokenizer
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.speculator.service import SpeculatorService
from rlbus.services.speculator.settings import SpeculatorSettings
from tests.integration.helpers import broadcast_running, dead_letters, eventually
from tests.running import workers_running
from tests.unit.conftest import fresh_model
from tests.unit.test_speculator import group

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_the_speculator_distils_from_its_own_durable_and_broadcast_announces_the_draft(
        bus: Any, run_name: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    draft_dir = save_draft(build_draft(fresh_model(tokenizer), layers=1), tokenizer, tmp_path / "draft")
    s = bus.subjects
    bad = group(tokenizer, "bad", version=2, bad_id=True)
    good = [group(tokenizer, f"g{i}", version=2 + i) for i in range(2)]
    await bus.publish(s.scored("train"), b"\x00not msgpack", msg_id="scored.garbage")
    for g in [bad, *good]:
        await bus.publish(s.scored("train"), g.encode(), msg_id=f"scored.{g.task.task_id}")

    cfg = SpeculatorSettings(draft_model_path=str(draft_dir), batch_samples=4, publish_every=2)
    life = Lifecycle(grace=2.0)
    async with broadcast_running(bus, run_name, tmp_path) as broadcast:
        service = await SpeculatorService.build(RunSettings(run=run_name, run_dir=str(tmp_path)), cfg, bus=bus,
                                                life=life)
        await service.resume()
        async with workers_running(life, service, timeout=30):
            await eventually(lambda: broadcast.draft.latest == 1, timeout=60)
    manifest = WeightManifest.decode(await bus.last(s.weights(draft_model_name("policy"))))
    assert (manifest.version, manifest.policy_version, manifest.state) == (1, 3, "published")
    assert await bus.last(s.weights("policy")) is None  # the policy's lane saw nothing
    letters = await dead_letters(bus, 2, timeout=20)
    assert {d.origin_subject for d in letters} == {s.scored("train")}
    assert any("group bad" in d.reason and "vocabulary" in d.reason for d in letters), [d.reason for d in letters]
    # Its own durable acked everything away; the trainer's (made only now) still finds every group.
    info = await bus.connection.js.consumer_info(s.stream("SCORED"), s.durable("speculator"))
    assert (info.num_pending, info.num_ack_pending) == (0, 0)
    trainer = bus.puller(ConsumerSpec(stream="SCORED", durable=s.durable("trainer"),
                                      filter_subjects=(s.scored("train"),)), ScoredGroup.decode)
    try:
        got = await trainer.fetch(10, 5.0)
        assert {d.msg.task.task_id for d in got} >= {"bad", "g0", "g1"}
    finally:
        await trainer.close()
