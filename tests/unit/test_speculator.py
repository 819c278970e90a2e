"""The speculator on the in-memory bus: scored groups in, distillation steps, draft versions out
through weight-broadcast's uploads (with the policy version they were distilled on); a group it
cannot train on goes to DEAD with the reason and the next one is still trained; a restart numbers
on from the newest published draft and starts from its weights; weight-broadcast announces the
draft under its own name; a generator's draft follower stages it (into a real TorchBackend's draft
slot at the end of the chain) and shows its lag behind the policy."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rlbus.bus.memory import MemoryBus
from rlbus.bus.subjects import draft_model_name
from rlbus.schemas import Rollout, SamplingParams, ScoredGroup, ScoredRollout, Shard, Task, WeightManifest
from rlbus.schemas.metric_keys import DraftKeys, SpeculatorKeys
from rlbus.schemas.rollout import spans_from_versions
from rlbus.services.broadcast.service import Broadcaster, BroadcastService
from rlbus.services.broadcast.settings import BroadcastSettings
from rlbus.services.generator.core import Generator
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.generator.status import Status
from rlbus.services.generator.torch_backend import TorchBackend
from rlbus.services.generator.weight_follower import WeightFollower, followed_draft
from rlbus.services.policy.draft_model import build_draft, save_draft
from rlbus.services.policy.load import load_policy, load_state_from_safetensors
from rlbus.services.policy.tokenizer import encode_prompt
from rlbus.services.runtime.config import ConfigError, RunSettings
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped
from rlbus.services.runtime.weights import ObjectStoreTransport
from rlbus.services.speculator.service import SpeculatorService
from rlbus.services.speculator.settings import SpeculatorSettings
from tests.running import workers_running
from tests.unit.conftest import fresh_model
from tests.unit.test_generator_intake import FakeBackend

RUN = "r"
DRAFT = draft_model_name("policy")


async def eventually(predicate: Callable[[], Any], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within the deadline")
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def draft_dir(tokenizer: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return save_draft(build_draft(fresh_model(tokenizer), layers=1), tokenizer,
                      tmp_path_factory.mktemp("draft") / "d")


def group(tokenizer: PreTrainedTokenizerFast, task_id: str, *, version: int, temperature: float = 1.0,
          bad_id: bool = False, rollouts: int = 4) -> ScoredGroup:
    prompt = encode_prompt(tokenizer, "12+34=")
    answer = [int(t) for t in tokenizer.encode("46", add_special_tokens=False)] + [int(tokenizer.eos_token_id)]
    if bad_id:
        answer[0] = 10_000  # no such token: a group the draft can never be trained on
    sampling = SamplingParams(temperature=temperature, max_new_tokens=6)
    task = Task(run=RUN, task_id=task_id, pool="train", env="addition", prompt="12+34=", answer="46",
                verifier="addition", group_size=rollouts, sampling=sampling)
    scored = [ScoredRollout(rollout=Rollout(
        rollout_id=f"{task_id}:{k}", task_id=task_id, index=k, token_ids=np.array(prompt + answer, dtype="<i4"),
        prompt_len=len(prompt), loss_mask=np.ones(len(answer), dtype="|u1"),
        behaviour_logprobs=np.full(len(answer), -0.5, dtype="<f4"),
        version_spans=spans_from_versions(np.array([version - 1] + [version] * (len(answer) - 1)))), reward=1.0)
        for k in range(rollouts)]
    return ScoredGroup(task=task, scored=scored, sampling=sampling)


async def send(bus: MemoryBus, *groups: ScoredGroup) -> None:
    for g in groups:
        await bus.publish(bus.subjects.scored("train"), g.encode(), msg_id=f"scored.{g.task.task_id}")


def uploads(bus: MemoryBus) -> list[WeightManifest]:
    return [WeightManifest.decode(d) for s, d in bus.messages("UPLOADS") if s == bus.subjects.weight_uploads(DRAFT)]


def announced(bus: MemoryBus, model: str) -> list[WeightManifest]:
    return [WeightManifest.decode(d) for s, d in bus.messages("WEIGHTS") if s == bus.subjects.weights(model)]


@contextlib.asynccontextmanager
async def speculating(bus: MemoryBus, draft_dir: Path, tmp_path: Path, **settings: Any):  # type: ignore[no-untyped-def]
    cfg = SpeculatorSettings(draft_model_path=str(draft_dir), **{"batch_samples": 4, "publish_every": 2, **settings})
    life = Lifecycle(grace=2.0)
    service = await SpeculatorService.build(RunSettings(run=RUN, run_dir=str(tmp_path)), cfg, bus=bus, life=life)
    await service.resume()
    async with workers_running(life, service, timeout=30):
        yield service


async def test_the_speculator_distils_scored_groups_and_uploads_a_draft_with_its_policy_version(
        tokenizer: PreTrainedTokenizerFast, draft_dir: Path, tmp_path: Path) -> None:
    bus = MemoryBus(RUN)
    async with speculating(bus, draft_dir, tmp_path) as service:
        # Two groups of four rollouts: two steps of four samples, so one upload (publish_every = 2).
        await send(bus, group(tokenizer, "a", version=3), group(tokenizer, "b", version=5))
        await eventually(lambda: len(uploads(bus)) == 1)
        metrics = service.learner.metrics()
    (manifest,) = uploads(bus)
    assert (manifest.model, manifest.version, manifest.state) == (DRAFT, 1, "uploaded")
    assert manifest.policy_version == 5  # the newest policy version its samples came from
    assert metrics[SpeculatorKeys.STEPS] == 2 and metrics[SpeculatorKeys.SAMPLES] == 8
    assert metrics[SpeculatorKeys.PUBLISHED_VERSION] == 1 and metrics[SpeculatorKeys.POLICY_VERSION_LAG] == 0
    assert metrics[SpeculatorKeys.LOSS] > 0
    # The uploaded bytes are the distilled draft: they load into the folder's model and differ from it.
    data = await ObjectStoreTransport(bus).read(manifest.shards[0])
    start, _ = load_policy(draft_dir)
    before = {k: v.clone() for k, v in start.state_dict().items()}
    load_state_from_safetensors(start, data)
    assert any(not torch.equal(before[k], v) for k, v in start.state_dict().items())
    assert bus.dead_letters == []


async def test_a_group_it_cannot_train_on_goes_to_dead_and_the_next_is_still_trained(
        tokenizer: PreTrainedTokenizerFast, draft_dir: Path, tmp_path: Path) -> None:
    bus = MemoryBus(RUN)
    async with speculating(bus, draft_dir, tmp_path, batch_samples=4, publish_every=1) as service:
        await send(bus, group(tokenizer, "bad", version=2, bad_id=True), group(tokenizer, "good", version=2))
        await eventually(lambda: len(uploads(bus)) == 1 and len(bus.dead_letters) == 1)
    (letter,) = bus.dead_letters
    assert "group bad" in letter.reason and "vocabulary" in letter.reason, letter.reason
    assert letter.deliveries == 1  # refused at once, not retried until max_deliver
    assert service.learner.c.groups_dead == 1 and service.learner.c.groups == 1
    assert [m.policy_version for m in uploads(bus)] == [2]


async def test_groups_at_another_temperature_are_skipped_not_dead(
        tokenizer: PreTrainedTokenizerFast, draft_dir: Path, tmp_path: Path) -> None:
    bus = MemoryBus(RUN)
    async with speculating(bus, draft_dir, tmp_path) as service:
        await send(bus, group(tokenizer, "t1", version=1, temperature=0.7), group(tokenizer, "t2", version=1),
                   group(tokenizer, "greedy", version=1, temperature=0.0))
        await eventually(lambda: service.learner.c.groups + service.learner.c.groups_skipped == 3)
    assert service.learner.c.temperature == 0.7 and service.learner.distiller.temperature == 0.7
    assert service.learner.c.skipped_why == {"other_temperature": 1, "greedy": 1}
    assert bus.dead_letters == []


async def test_a_restart_resumes_from_the_newest_published_draft(
        tokenizer: PreTrainedTokenizerFast, draft_dir: Path, tmp_path: Path) -> None:
    bus = MemoryBus(RUN)
    cfg = BroadcastSettings()
    life = Lifecycle(grace=1.0)
    broadcast = BroadcastService(RunSettings(run=RUN), cfg, bus=bus, life=life,
                                 broadcaster=Broadcaster(ObjectStoreTransport(bus), cfg, model="policy"))
    await broadcast.resume()
    b_task = asyncio.create_task(run_until_stopped(life, *broadcast.workers()))
    try:
        async with speculating(bus, draft_dir, tmp_path, publish_every=1):
            await send(bus, group(tokenizer, "a", version=4))
            await eventually(lambda: [m.version for m in announced(bus, DRAFT)] == [1])
        async with speculating(bus, draft_dir, tmp_path, publish_every=1) as again:
            assert again.learner.c.published_version == 1 and again.learner.c.published_on == 4
            await send(bus, group(tokenizer, "b", version=6))
            await eventually(lambda: [m.version for m in announced(bus, DRAFT)] == [1, 2])
    finally:
        life.shutdown()
        await asyncio.wait_for(b_task, 20)
    assert [m.policy_version for m in announced(bus, DRAFT)] == [4, 6]
    assert announced(bus, "policy") == []  # the policy's lane is untouched
    assert broadcast.draft.latest == 2 and broadcast.b.latest == -1


async def test_a_restart_whose_draft_bytes_are_gone_still_numbers_above_them(
        tokenizer: PreTrainedTokenizerFast, draft_dir: Path, tmp_path: Path) -> None:
    bus = MemoryBus(RUN)
    gone = WeightManifest(model=DRAFT, version=5, transport="objstore", policy_version=3, shards=[Shard(
        name="model.safetensors", sha256="0" * 64, size=1, location="weights/policy-draft/v00000005/model.safetensors")])
    await bus.publish(bus.subjects.weights(DRAFT), gone.encode(), msg_id=gone.msg_id)
    async with speculating(bus, draft_dir, tmp_path, publish_every=1) as service:
        assert service.learner.c.published_version == 5  # the folder's weights, numbered above v5
        await send(bus, group(tokenizer, "a", version=4))
        await eventually(lambda: [m.version for m in uploads(bus)] == [6])


async def test_no_draft_folder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="draft_model_path"):
        await SpeculatorService.build(RunSettings(run=RUN, run_dir=str(tmp_path)), SpeculatorSettings(),
                                      bus=MemoryBus(RUN), life=Lifecycle())


# --- generators follow the draft ------------------------------------------------------------------

class FakeDraftBackend(FakeBackend):
    """A backend with a draft slot: records the draft versions staged (drafter "model")."""

    def __init__(self) -> None:
        super().__init__()
        self.draft_version = 0
        self.drafts: list[int] = []

    def stage_draft(self, version: int, weights: bytes | memoryview) -> None:
        self.drafts.append(version)
        self.draft_version = version


def draft_follower(bus: MemoryBus, backend: Any, tmp_path: Path) -> tuple[WeightFollower, Generator]:
    gen = Generator(backend, GeneratorSettings(instance="gen-0"), ["train"])
    status = Status(Beat(bus, bus.subjects, "generator", "gen-0", period=60.0), gen)
    return WeightFollower(bus, bus.subjects.weights(DRAFT), gen, status, run_dir=str(tmp_path),
                          followed=followed_draft(backend)), gen


async def test_the_draft_follower_stages_draft_versions_and_shows_their_lag(tmp_path: Path) -> None:
    bus = MemoryBus(RUN)
    backend = FakeDraftBackend()
    backend.version = 7  # the live policy
    follower, gen = draft_follower(bus, backend, tmp_path)
    data = b"draft weights v2"
    info = await bus.objects.put("weights/policy-draft/v00000002/model.safetensors", data)
    manifest = WeightManifest(model=DRAFT, version=2, transport="objstore", policy_version=4,
                              shards=[Shard(name="model.safetensors", sha256=info.sha256, size=info.size,
                                            location="weights/policy-draft/v00000002/model.safetensors")])
    await bus.publish(bus.subjects.weights(DRAFT), manifest.encode(), msg_id=manifest.msg_id)
    watch = aiter(bus.watch(bus.subjects.weights(DRAFT), deliver="all"))
    await follower.on_manifest(await anext(watch))
    assert backend.drafts == [2] and backend.staged == []  # the draft slot, never the policy's
    assert follower.metrics() == {DraftKeys.VERSION: 2.0, DraftKeys.VERSION_LAG: 3.0,
                                  "generator/draft_refused": 0.0}
    # A forged draft version is refused (DEAD) without touching the policy's refusal count.
    forged = WeightManifest(model=DRAFT, version=3, transport="objstore", shards=[Shard(
        name="model.safetensors", sha256="0" * 64, size=1, location="weights/policy-draft/v00000002/model.safetensors")])
    await bus.publish(bus.subjects.weights(DRAFT), forged.encode(), msg_id=forged.msg_id)
    await follower.on_manifest(await anext(watch))
    assert backend.drafts == [2] and gen.weights_refused == 0 and follower.metrics()["generator/draft_refused"] == 1
    assert [d.reason for d in bus.dead_letters] == ["weights_refused"]


async def test_a_distilled_draft_reaches_a_torch_generators_draft_slot(
        tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    """speculator -> weight-broadcast -> the generator's draft follower -> TorchBackend.stage_draft:
    the draft slot swaps to the distilled version and holds the speculator's weights."""
    policy = fresh_model(tokenizer)
    policy_dir = tmp_path / "policy"
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    draft_dir = save_draft(build_draft(policy, layers=1), tokenizer, tmp_path / "draft")
    backend = TorchBackend(str(policy_dir), speculative={"drafter": "model", "draft_model_path": str(draft_dir)})
    assert backend.draft_version == 0
    bus = MemoryBus(RUN)
    follower, _ = draft_follower(bus, backend, tmp_path)
    cfg = BroadcastSettings()
    life = Lifecycle(grace=1.0)
    broadcast = BroadcastService(RunSettings(run=RUN), cfg, bus=bus, life=life,
                                 broadcaster=Broadcaster(ObjectStoreTransport(bus), cfg, model="policy"))
    tasks = asyncio.create_task(run_until_stopped(life, *broadcast.workers(), follower.follow))
    try:
        async with speculating(bus, draft_dir, tmp_path / "run", publish_every=2) as service:
            await send(bus, group(tokenizer, "a", version=1), group(tokenizer, "b", version=1))
            await eventually(lambda: [m.version for m in announced(bus, DRAFT)] == [1])
            await eventually(lambda: backend.speculation.draft._pending is not None)  # type: ignore[union-attr]
            distilled = {k: v.clone() for k, v in service.learner.distiller.draft.state_dict().items()}
    finally:
        life.shutdown()
        await asyncio.wait_for(tasks, 20)
    slot = backend.speculation.draft  # type: ignore[union-attr]
    assert slot.maybe_swap() and backend.draft_version == 1  # what the sampler does before a drafting round
    live = slot.model.state_dict()
    assert all(torch.equal(live[k], v) for k, v in distilled.items())
    assert backend.version == 0  # the policy did not move


# --- `rlbus up` starts it only for drafter = "model" ---------------------------------------------------

def test_rlbus_up_starts_the_speculator_only_for_the_online_drafters(draft_dir: Path, tmp_path: Path) -> None:
    import tomllib

    from rlbus.services.catalog import SINGLETONS, singletons
    from rlbus.services.up.main import write_resolved_config
    from rlbus.services.up.settings import UpSettings

    assert "speculator" not in SINGLETONS and "speculator" not in singletons({})
    for drafter in ("off", "group", "static", "static+group"):
        assert "speculator" not in singletons({"generator": {"speculative": {"drafter": drafter}}})
    # The combined drafter drafts with the online model where the group has no match: it needs the speculator.
    assert singletons({"generator": {"speculative": {"drafter": "model+group"}}})[-1] == "speculator"
    data = {"generator": {"speculative": {"drafter": "model", "draft_model_path": str(draft_dir)}}}
    assert singletons(data)[-1] == "speculator" and set(SINGLETONS) < set(singletons(data))
    resolved = write_resolved_config(data, RunSettings(run=RUN), UpSettings(), tmp_path, "nats://127.0.0.1:1",
                                     tmp_path / "heldout.jsonl", None)
    table = tomllib.loads(resolved.read_text())["speculator"]
    # The draft the generators start from, through the run folder like the trainer's weights.
    assert table == {"transport": "file", "draft_model_path": str(draft_dir)}
