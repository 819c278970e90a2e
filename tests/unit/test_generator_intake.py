"""The generator service on the in-memory bus, with a fake backend (no model): what it takes, what it
publishes, and what it hands back or dead-letters.

What a user cares about: a replica never starts more training groups than the controller granted,
held-out tasks never wait for a grant, routed shares decide which pool the room goes to, a task
the environment refuses ends in DEAD with the environment's reason, a task that failed for a
passing reason (environment down, backend error) comes back and its grant with it, a group is on
ROLLOUTS before its task is acked, and a drained replica takes nothing more.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlbus.bus.memory import MemoryBus
from rlbus.schemas import (
    Admit,
    AssignPools,
    Concurrency,
    Control,
    Decision,
    DecisionClock,
    EnvReply,
    EnvReplyBatch,
    EnvResetBatch,
    Heartbeat,
    RolloutGroup,
    RunState,
    SamplingParams,
    SetMix,
    Shard,
    Task,
    WeightManifest,
)
from rlbus.schemas.metric_keys import GeneratorKeys
from rlbus.services.generator import service as generator_service
from rlbus.services.generator.batch import BatchDriver
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle

RUN = "test"
INSTANCE = "gen-0"


@dataclass
class FakeSample:
    """What a backend returns per completion (``rlbus.services.policy.sampler.SampleOut``'s fields)."""

    completion_ids: list[int]
    behaviour_logprobs: np.ndarray
    token_versions: np.ndarray
    finish_reason: str = "length"


class FakeBackend:
    """Answers every prompt at once with two tokens of its live version; can fail on purpose."""

    eos_id = None

    def __init__(self, *, failures: int = 0) -> None:
        self.version = 0
        self.slowdown = 1.0
        self.failures = failures
        self.calls: list[int] = []  # prompts per sample call
        self.staged: list[tuple[int, bytes]] = []
        self._pending: int | None = None

    def _samples(self, prompts: list[list[int]], n: int, version: int) -> list[list[Any]]:
        return [[FakeSample([7, 8], np.array([-0.1, -0.2], np.float32), np.full(2, version, np.int64))
                 for _ in range(n)] for _ in prompts]

    def sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("the accelerator fell over")
        self.calls.append(len(prompts))
        return self._samples(prompts, n, self.version)

    def stage(self, version: int, weights: bytes | memoryview) -> None:
        self.staged.append((version, bytes(weights)))
        self._pending = version

    def apply_staged(self) -> bool:
        if self._pending is None:
            return False
        self.version, self._pending = self._pending, None
        return True

    def decode(self, ids: list[int]) -> str:
        return "".join(str(i % 10) for i in ids)

    def metrics(self) -> dict[str, float]:
        return {}


class FakePinnedBackend(FakeBackend):
    """With a second copy for held-out rounds (``PinnedSampling``), starting at version 0."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned_version: int | None = 0
        self.pinned_calls: list[tuple[int, bytes | None]] = []

    def sample_at(self, version: int, weights: bytes | memoryview | None, prompts: list[list[int]], n: int,
                  sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        self.pinned_calls.append((version, None if weights is None else bytes(weights)))
        self.pinned_version = version
        return self._samples(prompts, n, version)


class RecordingBus(MemoryBus):
    """Notes, for every group published, whether its task was still un-acked on TASKS at that moment."""

    def __init__(self) -> None:
        super().__init__(RUN)
        self.settles: list[tuple[str, str, bool]] = []  # (msg id published, the group's msg_id, task still held)

    async def publish_many(self, items: Sequence[tuple[str, bytes, str]], *, headers: dict[str, str] | None = None,
                           item_headers: Sequence[dict[str, str]] | None = None) -> None:
        held = {Task.decode(data).task_id for _, data in self.messages("TASKS")}
        for _, data, msg_id in items:
            group = RolloutGroup.decode(data)
            self.settles.append((msg_id, group.msg_id, group.task.task_id in held))
        await super().publish_many(items, headers=headers, item_headers=item_headers)


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        await asyncio.sleep(0.02)


def env_answer(tasks: list[Task]) -> EnvReplyBatch:
    """The fake environment: prompt ids for every task, an error for a prompt starting with 'refuse'."""
    return EnvReplyBatch(replies=[
        EnvReply(episode_id=t.task_id, error="no such puzzle: 'refuse-me'" if t.prompt.startswith("refuse") else "",
                 observation_ids=np.array([] if t.prompt.startswith("refuse") else [1, 2, 3], dtype="<i4"))
        for t in tasks])


class Harness:
    """One generator service on a ``RecordingBus``, a fake environment, and the controller's side."""

    def __init__(self, tmp_path: Path, *, backend: FakeBackend | None = None, env: bool = True,
                 pools: Sequence[str] = ("train",), **gen: Any) -> None:
        self.bus = RecordingBus()
        self.s = self.bus.subjects
        self.life = Lifecycle(grace=1.0)
        self.backend = backend or FakeBackend()
        self.run_cfg = RunSettings(run=RUN, run_dir=str(tmp_path), pools=list(pools), group_size=2, batch_groups=4)
        self.cfg = GeneratorSettings(instance=INSTANCE, **{"min_batch_groups": 1, "batch_wait_s": 0.0, **gen})
        self.env = env
        self.boot = ""
        self.clock = DecisionClock()  # seqs as the controller issues them
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Harness:
        if self.env:
            await self.start_env()
        self.task = asyncio.create_task(generator_service.run(self.run_cfg, self.cfg, bus=self.bus, life=self.life,
                                                              backend=self.backend))
        await eventually(lambda: self.heartbeat() is not None, what="a first heartbeat")
        self.boot = str(self.info()[GeneratorKeys.INFO_BOOT])
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.life.shutdown()
        assert self.task is not None
        await asyncio.wait_for(self.task, 5)
        await self.bus.close()

    async def start_env(self) -> None:
        async def reset_batch(data: bytes) -> bytes:
            return env_answer(EnvResetBatch.decode(data).tasks).encode()

        await self.bus.serve(self.s.env_any("reset_batch"), reset_batch, queue="environment")

    # --- the controller's side ------------------------------------------------------------------
    def heartbeat(self) -> Heartbeat | None:
        beats = [Heartbeat.decode(d) for subj, d in self.bus.messages("METRICS")
                 if subj == self.s.metrics("generator", INSTANCE)]
        return beats[-1] if beats else None

    def metric(self, key: str) -> float:
        hb = self.heartbeat()
        return hb.metrics.get(key, 0.0) if hb else 0.0

    def info(self) -> dict[str, Any]:
        hb = self.heartbeat()
        return hb.info if hb else {}

    async def decide(self, decision: Decision, *, seq: int | None = None, instance: str = INSTANCE,
                     on: str | None = None) -> int:
        """Publish a decision on its own subject (or on ``on``, to send it astray); returns its seq."""
        if seq is None:
            seq = self.clock.next()
        else:
            self.clock.observe(seq)
        ctl = Control(seq=seq, decision=decision, target_service="generator", target_instance=instance,
                      reason="test", issued_at=time.time(), issuer="test")
        subject = on or self.s.control_action("generator", instance, ctl.action)
        await self.bus.publish(subject, ctl.encode(), msg_id=f"{ctl.msg_id}.{subject}")
        return seq

    async def admit(self, grant_total: int, **kw: Any) -> int:
        return await self.decide(Admit(boot=self.boot, grant_total=grant_total), **kw)

    # --- tasks and groups -----------------------------------------------------------------------
    async def tasks(self, pool: str, n: int, *, prefix: str = "", evaluate: bool = False,
                    prompt: str = "1+1=", **meta: Any) -> list[str]:
        ids = [f"{prefix or pool}-{i}" for i in range(n)]
        for task_id in ids:
            t = Task(run=RUN, task_id=task_id, pool=pool, env="addition", prompt=prompt, answer="2", group_size=2,
                     eval=evaluate, metadata=dict(meta), sampling=SamplingParams(max_new_tokens=2))
            await self.bus.publish(self.s.tasks(pool), t.encode(), msg_id=t.msg_id)
        return ids

    def groups(self) -> list[RolloutGroup]:
        return [RolloutGroup.decode(d) for _, d in self.bus.messages("ROLLOUTS")]

    def published(self) -> Counter[str]:
        return Counter(g.task.pool for g in self.groups())

    def waiting(self, pool: str) -> int:
        """Tasks of ``pool`` still on TASKS (not acked, not terminated)."""
        return sum(subj == self.s.tasks(pool) for subj, _ in self.bus.messages("TASKS"))


async def settle(seconds: float = 0.5) -> None:
    """Give the service time to do something it should not (asserted afterwards)."""
    await asyncio.sleep(seconds)


# ---------------------------------------------------------------------------------------------
# admission


async def test_tasks_beyond_the_grant_are_not_taken(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        await h.tasks("train", 10)
        await settle(0.3)
        assert h.groups() == [], "nothing is started before the controller grants it"
        await h.admit(4)
        await eventually(lambda: len(h.groups()) == 4, what="4 groups published")
        await settle()
        assert len(h.groups()) == 4 and h.waiting("train") == 6
        await eventually(lambda: h.metric(GeneratorKeys.GROUPS_STARTED) == 4
                         and h.metric(GeneratorKeys.GRANT_TOTAL) == 4, what="the heartbeat to show 4 started of 4")
        # Every name the controller reads from a generator heartbeat is emitted (metrics and info).
        hb = h.heartbeat()
        named = {getattr(GeneratorKeys, k) for k in vars(GeneratorKeys) if k.isupper()}
        assert {k for k in named if not k.startswith("generator/")} <= set(hb.info), hb.info
        assert {k for k in named if k.startswith("generator/")} <= set(hb.metrics), sorted(hb.metrics)
        assert any(GeneratorKeys.parse_pool_published(k) == "train" for k in hb.metrics), sorted(hb.metrics)
        await h.admit(7)  # cumulative: three more
        await eventually(lambda: len(h.groups()) == 7, what="7 groups published")
        await settle()
        assert len(h.groups()) == 7 and h.waiting("train") == 3


async def test_eval_tasks_are_taken_without_admission(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        await h.tasks("train", 3)
        await h.tasks("eval", 5, evaluate=True)
        await eventually(lambda: h.published()["eval"] == 5, what="the held-out tasks sampled")
        await settle(0.3)
        assert h.published() == Counter(eval=5) and h.waiting("train") == 3
        await eventually(lambda: h.metric("generator/eval_groups_published") == 5, what="the heartbeat count")
        assert h.metric(GeneratorKeys.GROUPS_STARTED) == 0, "held-out groups take nothing of the grant"


async def test_routed_shares_split_the_room(tmp_path: Path) -> None:
    async with Harness(tmp_path, pools=("a", "b"), max_batch_groups=8) as h:
        await h.tasks("a", 20)
        await h.tasks("b", 20)
        await h.decide(AssignPools(pools=["zzz"]))  # not a pool this replica serves: refused
        await h.decide(AssignPools(pools=["a", "b"], shares={"a": 0.75, "b": 0.25}))
        await h.admit(8)
        await eventually(lambda: len(h.groups()) == 8, what="8 groups published")
        assert h.published() == Counter(a=6, b=2)
        assert h.backend.calls == [8], "one batch, the room split inside it"
        await eventually(lambda: h.info().get(GeneratorKeys.INFO_SHARES) == {"a": 0.75, "b": 0.25},
                         what="the heartbeat to show the shares")
        assert h.info()[GeneratorKeys.INFO_POOLS] == ["a", "b"]
        await eventually(lambda: h.metric(GeneratorKeys.pool_published("a")) == 6, what="per-pool counts")
        # A new routing applies from the next batch; the concurrency decision caps the batch.
        await h.decide(AssignPools(pools=["b", "a"]))  # no shares: the first pool with work
        await h.decide(Concurrency(max_groups=3))
        await h.admit(11)
        await eventually(lambda: len(h.groups()) == 11, what="11 groups published")
        assert h.published() == Counter(a=6, b=5) and h.backend.calls == [8, 3]


async def test_a_small_grant_waits_to_grow_into_a_fuller_batch(tmp_path: Path) -> None:
    async with Harness(tmp_path, min_batch_groups=4, batch_wait_s=2.0) as h:
        await h.tasks("train", 10)
        await h.admit(2)
        await settle(0.3)
        assert h.groups() == [], "two groups wait for the grant to grow"
        await h.admit(4)
        await eventually(lambda: len(h.groups()) == 4, what="one batch of 4")
        assert h.backend.calls == [4]
        # A grant that does not grow is sampled anyway once batch_wait_s has passed.
        await h.admit(6)
        await eventually(lambda: len(h.groups()) == 6, timeout=10.0, what="the small batch after the wait")
        assert h.backend.calls == [4, 2]


# ---------------------------------------------------------------------------------------------
# what fails


async def test_a_task_the_environment_refuses_is_dead_lettered_with_its_reason(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        await h.tasks("train", 1, prefix="bad", prompt="refuse-me")
        await h.tasks("train", 4)
        await h.admit(4)
        await eventually(lambda: len(h.groups()) == 4, what="the 4 good tasks published")
        [letter] = h.bus.dead_letters
        assert letter.reason == "environment refused task 'bad-0': no such puzzle: 'refuse-me'"
        assert Task.decode(letter.data).task_id == "bad-0" and h.waiting("train") == 0
        # The refused task never started: the grant of 4 went to the 4 good ones.
        await eventually(lambda: h.metric(GeneratorKeys.GROUPS_STARTED) == 4
                         and h.metric("generator/dead_lettered") == 1, what="the heartbeat counts")


async def _redelivered(h: Harness) -> int:
    [consumer] = [c for st in await h.bus.streams() for c in st.consumers if c.name == "generator_train"]
    return consumer.redelivered


async def test_a_batch_is_held_while_the_environment_is_unreachable_and_costs_no_delivery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Naking on "no responders" had the intake cycle the whole backlog through an environment
    # restart, one delivery per cycle, until max_deliver dead-lettered it (a silent stall).
    monkeypatch.setattr(BatchDriver, "ENV_RETRY_S", 0.05)
    monkeypatch.setattr(BatchDriver, "ENV_RETRY_MAX_S", 0.1)
    async with Harness(tmp_path, env=False) as h:
        await h.tasks("train", 4)
        await h.admit(4)
        await asyncio.sleep(1.0)  # the same reset retried several times meanwhile
        assert h.groups() == [] and h.bus.dead_letters == [] and await _redelivered(h) == 0
        await h.start_env()
        await eventually(lambda: len(h.groups()) == 4, what="the held batch published once the environment answers")
        assert h.bus.dead_letters == [] and await _redelivered(h) == 0


async def test_past_the_outage_bound_the_tasks_come_back_with_their_grant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BatchDriver, "ENV_RETRY_S", 0.1)
    monkeypatch.setattr(BatchDriver, "ENV_RETRY_MAX_S", 0.1)
    monkeypatch.setattr(BatchDriver, "ENV_OUTAGE_S", 0.3)
    async with Harness(tmp_path, env=False) as h:
        await h.tasks("train", 4)
        await h.admit(4)
        # Still unreachable after ENV_OUTAGE_S: the tasks are naked (not dead-lettered) and taken again.
        deadline = time.monotonic() + 10.0
        while await _redelivered(h) < 4:
            assert time.monotonic() < deadline, "the tasks were not redelivered"
            await asyncio.sleep(0.02)
        assert h.groups() == [] and h.bus.dead_letters == [] and h.waiting("train") == 4
        await h.start_env()
        # Only a grant given back each time lets the same 4 tasks through on a grant of 4.
        await eventually(lambda: len(h.groups()) == 4, what="the tasks published once the environment answers")
        assert h.bus.dead_letters == []
        await eventually(lambda: h.metric(GeneratorKeys.GROUPS_STARTED) == 4, what="4 started in all")


async def test_a_sampling_failure_naks_the_tasks_and_gives_the_grant_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BatchDriver, "SAMPLING_RETRY_S", 0.2)
    # Three failures: the batch, then both of its halves (the driver bisects a failed batch to find
    # a task that causes it; both halves failing says the backend fails whatever the input).
    async with Harness(tmp_path, backend=FakeBackend(failures=3)) as h:
        await h.tasks("train", 4)
        await h.admit(4)
        await eventually(lambda: len(h.groups()) == 4, what="the tasks published after the failure")
        assert h.backend.calls == [4] and h.bus.dead_letters == []
        await eventually(lambda: h.metric(GeneratorKeys.GROUPS_STARTED) == 4
                         and h.metric("generator/tasks_redelivered") == 4, what="the heartbeat counts")


# ---------------------------------------------------------------------------------------------
# publishing


async def test_groups_are_published_before_their_tasks_are_acked(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        ids = await h.tasks("train", 6)
        await h.admit(6)
        await eventually(lambda: len(h.groups()) == 6, what="6 groups published")
        await eventually(lambda: h.waiting("train") == 0, what="the tasks acked")
        assert sorted(m for m, _, _ in h.bus.settles) == sorted(f"rollouts.{i}" for i in ids)
        assert all(published == own for published, own, _ in h.bus.settles), "published under RolloutGroup.msg_id"
        assert all(held for _, _, held in h.bus.settles), "every task was still un-acked when its group was published"
        g = h.groups()[0]
        assert g.generator_id == INSTANCE and [r.index for r in g.rollouts] == [0, 1]
        assert g.rollouts[0].token_ids.tolist() == [1, 2, 3, 7, 8] and g.rollouts[0].prompt_len == 3


# ---------------------------------------------------------------------------------------------
# run state and decisions


async def test_a_drain_stops_intake_and_gives_the_unstarted_grant_back(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        await h.tasks("train", 8)
        await h.admit(4)
        await eventually(lambda: len(h.groups()) == 4, what="4 groups published")
        await h.decide(RunState(state="pause", boot=h.boot))
        before_drain = await h.admit(6)
        await eventually(lambda: h.metric(GeneratorKeys.GRANT_TOTAL) == 6, what="a grant of 6 while paused")
        drain = await h.decide(RunState(state="drain", boot=h.boot))
        await eventually(lambda: h.heartbeat().state == "drained"  # type: ignore[union-attr]
                         and h.metric(GeneratorKeys.GRANT_TOTAL) == 4, what="drained, the 2 unstarted given back")
        await h.admit(8, seq=(before_drain + drain) // 2)  # issued before the drain: void
        await settle(1.2)  # two heartbeats
        assert h.metric(GeneratorKeys.GRANT_TOTAL) == 4
        await h.admit(8)  # issued after: held, but nothing starts while draining, held-out tasks neither
        await h.tasks("eval", 2, evaluate=True)
        await eventually(lambda: h.metric(GeneratorKeys.GRANT_TOTAL) == 8, what="the newer grant held")
        await settle()
        assert len(h.groups()) == 4 and h.waiting("train") == 4 and h.waiting("eval") == 2
        assert h.metric(GeneratorKeys.GROUPS_STARTED) == 4
        await h.decide(RunState(state="resume"))
        await eventually(lambda: len(h.groups()) == 10, what="the rest after a resume")


async def test_a_decision_for_another_boot_is_ignored(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        await h.tasks("train", 2)
        await h.decide(Admit(boot="predecessor", grant_total=2))
        await h.decide(RunState(state="pause", boot="predecessor"))
        await settle(0.3)
        assert h.groups() == [] and h.heartbeat().state == "running"  # type: ignore[union-attr]
        await h.admit(2)
        await eventually(lambda: len(h.groups()) == 2, what="the grant of this boot used")


async def test_a_control_that_does_not_decode_or_is_misplaced_is_dead_lettered(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        await h.tasks("train", 2)
        garbage_on = h.s.control_action("generator", INSTANCE, "admit")
        await h.bus.publish(garbage_on, b"\x93not a control", msg_id="ctl.garbage")
        await h.admit(2, on=h.s.control_action("generator", INSTANCE, "pause"))  # an admit on the pause subject
        await h.decide(SetMix(mix={"train": 1.0}))  # the controller's decision, sent to a generator
        await eventually(lambda: len(h.bus.dead_letters) == 3, what="3 dead letters")
        reasons = [d.reason for d in h.bus.dead_letters]
        assert reasons == ["bad_control", "misplaced_control", "misplaced_control"]
        assert "not valid msgpack" in h.bus.dead_letters[0].error and h.bus.dead_letters[0].data == b"\x93not a control"
        assert "publish it on" in h.bus.dead_letters[1].error and ".admit" in h.bus.dead_letters[1].error
        assert "not for generators" in h.bus.dead_letters[2].error
        assert h.groups() == [], "the misplaced admit was not applied"
        await h.admit(2)  # the service kept going
        await eventually(lambda: len(h.groups()) == 2, what="a proper admit applied")
        await eventually(lambda: h.metric("generator/control_refused") == 3, what="the refusals counted")


async def test_the_heartbeat_carries_every_key_the_controller_reads(tmp_path: Path) -> None:
    async with Harness(tmp_path, max_batch_groups=5) as h:
        hb = h.heartbeat()
        assert hb is not None
        names = {k: v for k, v in vars(GeneratorKeys).items() if k.isupper()}
        metrics = [v for k, v in names.items() if not k.startswith("INFO_")]
        info = [v for k, v in names.items() if k.startswith("INFO_")]
        assert metrics and all(k in hb.metrics for k in metrics), set(metrics) - set(hb.metrics)
        assert info and all(k in hb.info for k in info), set(info) - set(hb.info)
        assert hb.info[GeneratorKeys.INFO_MAX_BATCH_GROUPS] == 5 and hb.metrics[GeneratorKeys.CONCURRENCY] == 5
        await h.tasks("train", 3)
        await h.admit(3)
        await eventually(lambda: h.metric(GeneratorKeys.pool_published("train")) == 3, what="the per-pool count")


# ---------------------------------------------------------------------------------------------
# weights


async def _publish_weights(h: Harness, version: int, data: bytes, *, sha256: str | None = None) -> None:
    location = f"weights/v{version}/model.safetensors"
    await h.bus.objects.put(location, data)
    manifest = WeightManifest(model="policy", version=version, transport="objstore", state="published",
                              shards=[Shard(name="model.safetensors", sha256=sha256 or hashlib.sha256(data).hexdigest(),
                                            size=len(data), location=location)])
    await h.bus.publish(h.s.weights("policy"), manifest.encode(), msg_id=f"weights.{version}")


async def test_new_weights_are_staged_and_refused_ones_dead_lettered(tmp_path: Path) -> None:
    async with Harness(tmp_path) as h:
        await _publish_weights(h, 1, b"v1 weights")
        await eventually(lambda: h.heartbeat().version == 1, what="v1 swapped in while idle")  # type: ignore[union-attr]
        assert h.backend.staged == [(1, b"v1 weights")]
        await _publish_weights(h, 2, b"v2 weights", sha256="0" * 64)  # bytes that do not match the manifest
        await eventually(lambda: len(h.bus.dead_letters) == 1, what="the forged version dead-lettered")
        assert h.bus.dead_letters[0].reason == "weights_refused" and "sha256" in h.bus.dead_letters[0].error
        assert h.backend.staged == [(1, b"v1 weights")] and h.heartbeat().version == 1  # type: ignore[union-attr]
        # A freshness floor above the live version holds training starts until new weights arrive.
        await h.tasks("train", 2)
        await h.decide(Admit(boot=h.boot, grant_total=2, min_version=3))
        await settle(0.3)
        assert h.groups() == []
        await _publish_weights(h, 3, b"v3 weights")
        await eventually(lambda: len(h.groups()) == 2, what="the groups once v3 is live")
        assert {int(v) for g in h.groups() for r in g.rollouts for v in r.version_spans[:, 1]} == {3}


async def test_held_out_rounds_sample_the_version_they_were_scheduled_at(tmp_path: Path) -> None:
    backend = FakePinnedBackend()
    async with Harness(tmp_path, backend=backend) as h:
        await _publish_weights(h, 1, b"v1 weights")
        await _publish_weights(h, 2, b"v2 weights")
        await eventually(lambda: h.heartbeat().version == 2, what="v2 live")  # type: ignore[union-attr]
        await h.tasks("eval", 2, prefix="r0", evaluate=True, eval_version=0)
        await eventually(lambda: len(h.groups()) == 2, what="round 0")
        await h.tasks("eval", 2, prefix="r1", evaluate=True, eval_version=1)
        await eventually(lambda: len(h.groups()) == 4, what="round 1")
        # The pinned copy held v0 (no weights needed), then was loaded with v1's bytes; live stayed v2.
        assert backend.pinned_calls == [(0, None), (1, b"v1 weights")]
        versions = {g.task.task_id: {int(v) for r in g.rollouts for v in r.version_spans[:, 1]} for g in h.groups()}
        assert versions == {"r0-0": {0}, "r0-1": {0}, "r1-0": {1}, "r1-1": {1}}
        await eventually(lambda: h.metric("generator/eval_pinned") == 4, what="the pinned count")
