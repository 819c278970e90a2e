"""reward service — score rollout groups with registered verifiers.

consumes:  rl.<run>.rollouts.<pool>  (RolloutGroup)  durable 'reward', work queue
produces:  rl.<run>.scored.<pool>    (ScoredGroup)   msg id 'scored.<task_id>' (dedupe on redelivery)
waits for: nothing
unblocked by: generators publishing groups
A verifier exception marks that rollout ``verifier_error`` (excluded by the trainer, counted);
a rollout whose episode ended on an environment failure (``Rollout.env_error``) is marked
``env_failure`` and not scored (excluded the same way: ``ScoredRollout.valid``); tampering a
verifier detects is scored 0 with its reason in ``verifier_detail`` and counted;
an unknown verifier name poisons the group to DEAD with the registered names.
"""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING

from rlbus.bus.protocol import Bus, ConsumerSpec, Delivery, Poison
from rlbus.bus.subjects import Subjects, pool_of
from rlbus.observability import tracing
from rlbus.observability.logging import get_logger
from rlbus.schemas import Rollout, RolloutGroup, ScoredGroup, ScoredRollout, Task
from rlbus.services.reward.settings import RewardSettings
from rlbus.services.reward.verifiers import VERIFIERS, Verifier, verifier_for
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped
from rlbus.services.runtime.registry import UnknownExtension

if TYPE_CHECKING:
    from rlbus.services.sandbox import Sandbox

log = get_logger()


class Scorer:
    def __init__(self, cfg: RewardSettings) -> None:
        self.cfg = cfg
        self.groups = 0
        self.rollouts = 0
        self.verifier_errors = 0
        self.env_failures = 0
        self.tampering = 0
        self.reward_sum = 0.0
        self.scored_rollouts = 0  # those with a trusted reward (the mean's denominator)
        self._verifiers: dict[str, Verifier] = {}
        self._sandbox: Sandbox | None = None

    def verifier(self, name: str) -> Verifier:
        """One instance per verifier name, kept: a sandboxed one holds the sandbox's run dirs."""
        if name not in self._verifiers:
            try:
                factory = VERIFIERS.get(name)
            except UnknownExtension as exc:
                raise Poison(str(exc)) from None
            if getattr(factory, "sandboxed", False):
                if self._sandbox is None:
                    from rlbus.services.sandbox import Sandbox

                    self._sandbox = Sandbox(self.cfg.sandbox)
                    log.info("sandbox_ready", isolation=self._sandbox.isolation.describe())
                self._verifiers[name] = factory(sandbox=self._sandbox)
            else:
                self._verifiers[name] = factory()
        return self._verifiers[name]

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()

    async def score(self, group: RolloutGroup) -> ScoredGroup:
        name = verifier_for(group.task)
        verifier = self.verifier(name)
        scored = [await self._one(name, verifier, group.task, r) for r in group.rollouts]
        self.groups += 1
        self.rollouts += len(scored)
        return ScoredGroup(task=group.task, scored=scored, sampling=group.sampling, generator_id=group.generator_id,
                           created_at=group.created_at, scored_at=time.time())

    async def _one(self, name: str, verifier: Verifier, task: Task, r: Rollout) -> ScoredRollout:
        if r.env_error:
            # The environment failed, not the policy: excluded from the loss (``valid`` is False),
            # never scored, so its reward 0 below is a placeholder no one trains on.
            self.env_failures += 1
            return ScoredRollout(rollout=r, reward=0.0, env_failure=True,
                                 verifier_detail=f"environment failure, not scored: {r.env_error}"[:2000])
        try:
            v = verifier(task, r)
            if inspect.isawaitable(v):
                v = await v
            reward = v.reward + self.cfg.format_weight * v.components.get("format", 0.0)
            out = ScoredRollout(rollout=r, reward=reward, components=v.components, verifier_detail=v.detail)
        except Exception as exc:  # a verifier bug (a NaN reward included) must not kill the service or score 0
            self.verifier_errors += 1
            log.warning("verifier_error", verifier=name, rollout=r.rollout_id, error=repr(exc))
            return ScoredRollout(rollout=r, reward=0.0, verifier_error=f"{name}: {exc!r}")
        if v.components.get("tampering"):
            self.tampering += 1
            log.warning("reward_tampering", verifier=name, rollout=r.rollout_id, detail=v.detail[:500])
        self.reward_sum += reward
        self.scored_rollouts += 1
        return out

    def metrics(self) -> dict[str, float]:
        return {"reward/groups": self.groups, "reward/rollouts": self.rollouts,
                "reward/verifier_errors": self.verifier_errors, "reward/env_failures": self.env_failures,
                "reward/tampering": self.tampering, "reward/mean": self.reward_sum / max(self.scored_rollouts, 1)}


class RewardService:
    """Scores each rollout group it pulls and publishes the scored group; the delivery is acked
    (by the bus's outcome rule) only after that publish, so a crash re-scores, never loses."""

    def __init__(self, run_cfg: RunSettings, cfg: RewardSettings, bus: Bus) -> None:
        self.bus = bus
        self.cfg = cfg
        self.subjects = Subjects(run_cfg.run)
        self.scorer = Scorer(cfg)
        self.spec = ConsumerSpec(stream="ROLLOUTS", durable=self.subjects.durable("reward"),
                                 filter_subjects=(self.subjects.all_of("rollouts"),), ack_wait=30, max_deliver=5,
                                 max_ack_pending=4 * cfg.batch)

    async def handle(self, group: RolloutGroup, d: Delivery[RolloutGroup]) -> None:
        # Under the bus's process span, in the group's task trace; the scored group is published
        # from inside, so the trainer's link points at this span's trace.
        with tracing.child_span(f"score {group.task.task_id}") as span:
            scored = await self.scorer.score(group)
            rewards = [s.reward for s in scored.scored]
            for k, v in {tracing.RUN: group.task.run, tracing.TASK_ID: group.task.task_id,
                         tracing.POOL: group.task.pool, tracing.ROLLOUT_COUNT: len(rewards),
                         tracing.ROLLOUT_IDS: [s.rollout.rollout_id for s in scored.scored], tracing.REWARDS: rewards,
                         tracing.REWARD_MEAN: sum(rewards) / max(len(rewards), 1),
                         tracing.GENERATOR_ID: group.generator_id}.items():
                span.set_attribute(k, v)
            await self.bus.publish(self.subjects.scored(pool_of(d.subject)), scored.encode(), msg_id=scored.msg_id)

    async def consume(self) -> None:
        await self.bus.consume(self.spec, RolloutGroup.decode, self.handle, batch=self.cfg.batch,
                               concurrency=self.cfg.concurrency)


async def run(run_cfg: RunSettings, cfg: RewardSettings, *, bus: Bus, life: Lifecycle) -> None:
    service = RewardService(run_cfg, cfg, bus)
    beat = Beat(bus, service.subjects, "reward", cfg.instance)
    beat.extra = service.scorer.metrics
    beat.state = "running"
    try:
        await run_until_stopped(life, lambda: beat.loop(life), service.consume)
    finally:
        service.scorer.close()
