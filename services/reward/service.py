"""reward service — score rollout groups with registered verifiers.

consumes:  rl.<run>.rollouts.<pool>  (RolloutGroup)  durable 'reward', work queue
produces:  rl.<run>.scored.<pool>    (ScoredGroup)   msg id 'scored.<task_id>' (dedupe on redelivery)
waits for: nothing
unblocked by: generators publishing groups
A verifier exception marks that rollout ``verifier_error`` (excluded by the trainer, counted);
an unknown verifier name poisons the group to DEAD with the registered names.
"""

from __future__ import annotations

import time

from bus.protocol import Bus, ConsumerSpec, Delivery, Poison
from bus.subjects import Subjects, pool_of
from observability import tracing
from observability.logging import get_logger
from schemas import RolloutGroup, ScoredGroup, ScoredRollout
from services.reward.settings import RewardSettings
from services.reward.verifiers import VERIFIERS, verifier_for
from services.runtime.config import RunSettings
from services.runtime.heartbeat import Beat
from services.runtime.lifecycle import Lifecycle, run_until_stopped
from services.runtime.registry import UnknownExtension

log = get_logger()


class Scorer:
    def __init__(self, cfg: RewardSettings) -> None:
        self.cfg = cfg
        self.groups = 0
        self.rollouts = 0
        self.verifier_errors = 0
        self.reward_sum = 0.0

    def score(self, group: RolloutGroup) -> ScoredGroup:
        name = verifier_for(group.task)
        try:
            verifier = VERIFIERS.create(name)
        except UnknownExtension as exc:
            raise Poison(str(exc)) from None
        scored = []
        for r in group.rollouts:
            try:
                v = verifier(group.task, r)
                reward = v.reward + self.cfg.format_weight * v.components.get("format", 0.0)
                scored.append(ScoredRollout(rollout=r, reward=reward, components=v.components, verifier_detail=v.detail))
                self.reward_sum += reward
            except Exception as exc:  # a verifier bug must not kill the service or score 0
                self.verifier_errors += 1
                log.warning("verifier_error", verifier=name, rollout=r.rollout_id, error=repr(exc))
                scored.append(ScoredRollout(rollout=r, reward=0.0, verifier_error=f"{name}: {exc!r}"))
        self.groups += 1
        self.rollouts += len(scored)
        return ScoredGroup(task=group.task, scored=scored, sampling=group.sampling, generator_id=group.generator_id,
                           created_at=group.created_at, scored_at=time.time())

    def metrics(self) -> dict[str, float]:
        return {"reward/groups": self.groups, "reward/rollouts": self.rollouts,
                "reward/verifier_errors": self.verifier_errors,
                "reward/mean": self.reward_sum / max(self.rollouts, 1)}


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
            scored = self.scorer.score(group)
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
    await run_until_stopped(life, lambda: beat.loop(life), service.consume)
