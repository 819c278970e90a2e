"""Batch assembly: which scored groups train, which are dropped, and why.  Pure, no I/O.

Per rollout: *stale* when its staleness (optimiser updates between the weights of its stalest
token's version and the trainer's, ``Lineage.staleness``: ``trainer_version - oldest token version``
unless a resumed trainer forked the versions, when samples of the lost lineage count every update
that separates them from the restored model) exceeds ``max_staleness`` (not trained on, counted;
its reward still counts in its group's baseline), *invalid* on a verifier error or
environment failure (not trained on, not in the baseline).  Per group: *duplicate* when its id
was already consumed (a redelivery after a crash), *filtered* when the counted rewards are all
equal (no learning signal: dynamic sampling), *stale* when no rollout is fresh enough, *invalid*
when no rollout is valid, or when the group cannot be trained on at all (``judge.judge_group``: a
reward beyond the bound, a token outside the vocabulary, more tokens than the model's context; or
a step refused it, ``put_back``).  Such a *refused* group carries its ``refusal``: it is
dead-lettered with it (terminated, not acked) once its ledger entry is durable, and so is every
redelivered copy of it.  Every dropped group is recorded with its reason; nothing vanishes.
A kept group can still go stale while it waits for a batch (``requeue_stale``): its outcome
moves from *train* to *stale*, and it is also counted as *stale_held*.  Outcomes are tallied per
pool and per generator as well (``Outcomes``), for the controller's balance accounting.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from rlbus.schemas import ScoredGroup
from rlbus.schemas.metric_keys import STALE_HELD
from rlbus.schemas.task import subject_token_problem
from rlbus.services.trainer.judge import InputLimits, judge_group
from rlbus.services.trainer.versions import Lineage


@dataclass
class GroupDecision:
    group: ScoredGroup
    handle: Any  # the delivery, settled by the service once the step is durable
    train_mask: list[bool]  # rollouts trained on
    baseline_mask: list[bool]  # rollouts whose reward counts in the baseline
    staleness: list[int]
    reason: str = "train"  # train | filtered | stale | invalid | duplicate
    refusal: str = ""  # why it can never be trained on: settled by a term with this reason, not an ack


MAX_GENERATORS = 1024  # generator ids reported per outcome (x5 metrics each, far below the heartbeat's bound)


@dataclass
class Outcomes:
    """Group outcomes (train, filtered, invalid, stale, and the ``stale_held`` part of stale) by
    pool and by generator, counted from zero by this process.  A duplicate is no outcome of its
    own: its original's counts.  A group without a generator id is counted per pool only."""

    by_pool: dict[str, Counter[str]] = field(default_factory=dict)
    by_generator: dict[str, Counter[str]] = field(default_factory=dict)

    def count(self, group: ScoredGroup, outcome: str, n: int = 1) -> None:
        self.by_pool.setdefault(group.task.pool, Counter())[outcome] += n
        if self._reportable(group.generator_id):
            self.by_generator.setdefault(group.generator_id, Counter())[outcome] += n

    def _reportable(self, generator: str) -> bool:
        """Each generator id becomes heartbeat metric names, and the id comes off the wire: one that
        is no subject token (a 3,000-character id), or one more than MAX_GENERATORS distinct ids,
        would make the trainer's own heartbeat unbuildable.  Such groups count per pool only."""
        if not generator or subject_token_problem(generator):
            return False
        return generator in self.by_generator or len(self.by_generator) < MAX_GENERATORS

    def total(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.by_pool.values())


@dataclass
class Assembler:
    batch_groups: int
    max_staleness: int
    kept: list[GroupDecision] = field(default_factory=list)
    dropped: list[GroupDecision] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    outcomes: Outcomes = field(default_factory=Outcomes)
    rollouts_stale: int = 0
    rollouts_invalid: int = 0
    lineage: Lineage = field(default_factory=Lineage)  # how the versions descend (forks of resumed trainers)
    limits: InputLimits = field(default_factory=InputLimits)  # what the trained model can score
    # Groups a step refused (id -> why), which the judge would let through: their copies are refused too.
    refused_by_step: dict[str, str] = field(default_factory=dict)

    def offer(self, group: ScoredGroup, handle: Any, *, version: int, consumed: Container[str]) -> GroupDecision:
        gid = group.task.task_id
        refusal = self.refused_by_step.get(gid) or judge_group(group, self.limits)
        staleness = [self.lineage.staleness(version, s.rollout) for s in group.scored]
        valid = [s.valid and not refusal for s in group.scored]
        fresh = [st <= self.max_staleness for st in staleness]
        train = [v and f for v, f in zip(valid, fresh, strict=True)]
        d = GroupDecision(group, handle, train, list(valid), staleness, refusal=refusal)
        rewards = {s.reward for s, b in zip(group.scored, valid, strict=True) if b}
        # A copy of a consumed or held group is a duplicate even when refused: it is the same
        # message, settled (with its refusal, if any) only once the original's entry is durable.
        if gid in consumed or any(k.group.task.task_id == gid for k in self.kept):
            d.reason = "duplicate"
        elif not any(valid):
            d.reason = "invalid"
        elif not any(train):
            d.reason = "stale"
        elif len(rewards) < 2:
            d.reason = "filtered"
        self.counts[d.reason] += 1
        if d.reason != "duplicate":
            self.outcomes.count(group, d.reason)
        if d.reason == "train":
            self.rollouts_stale += sum(v and not f for v, f in zip(valid, fresh, strict=True))
            self.rollouts_invalid += sum(not v for v in valid)
            self.kept.append(d)
        else:
            self.dropped.append(d)
        return d

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.batch_groups

    def take(self) -> tuple[list[GroupDecision], list[GroupDecision]]:
        """The next batch and every dropped group since the last take."""
        batch, self.kept = self.kept[: self.batch_groups], self.kept[self.batch_groups:]
        dropped, self.dropped = self.dropped, []
        return batch, dropped

    def put_back(self, batch: list[GroupDecision], dropped: list[GroupDecision], refused: dict[str, str]) -> None:
        """A step refused its input and made no version: the ``refused`` groups of ``batch`` (id ->
        why) become *invalid*, the others wait for the next batch, and ``dropped`` (taken with the
        batch) is held again to be recorded with the next step."""
        back: list[GroupDecision] = []
        out: list[GroupDecision] = []
        for d in batch:
            why = refused.get(d.group.task.task_id)
            if why is None:
                back.append(d)
                continue
            d.reason, d.refusal = "invalid", why
            d.train_mask = [False] * len(d.train_mask)
            d.baseline_mask = [False] * len(d.baseline_mask)
            self.counts["train"] -= 1
            self.counts["invalid"] += 1
            self.outcomes.count(d.group, "train", -1)
            self.outcomes.count(d.group, "invalid")
            out.append(d)
        self.refused_by_step.update(refused)
        held = [*dropped, *self.dropped]
        for d in held:  # copies already held are the same messages: dead-lettered alike
            if d.reason == "duplicate" and d.group.task.task_id in refused:
                d.refusal = refused[d.group.task.task_id]
        self.kept = back + self.kept
        self.dropped = [*out, *held]

    def requeue_stale(self, version: int) -> list[GroupDecision]:
        """After a version bump, kept groups may have become stale: re-judge them."""
        still, out = [], []
        for d in self.kept:
            d.staleness = [self.lineage.staleness(version, s.rollout) for s in d.group.scored]
            d.train_mask = [v and st <= self.max_staleness for v, st in zip(d.baseline_mask, d.staleness, strict=True)]
            if any(d.train_mask):
                still.append(d)
            else:
                d.reason = "stale"
                self.counts["train"] -= 1
                self.counts["stale"] += 1
                self.outcomes.count(d.group, "train", -1)
                self.outcomes.count(d.group, "stale")
                self.outcomes.count(d.group, STALE_HELD)
                out.append(d)
        self.kept = still
        self.dropped.extend(out)
        return out


def ready_to_ack(held: list[GroupDecision], committed: Container[str]) -> tuple[list[GroupDecision], list[GroupDecision]]:
    """Split what the trainer holds into what a checkpoint of ``committed`` ids lets it ack now and
    what must wait.  A duplicate is a redelivered copy of the same message as its original: acking
    it acks the original, so it waits until the original's id is committed (the original may still
    wait in a batch, and a crash would then lose it)."""
    now: list[GroupDecision] = []
    later: list[GroupDecision] = []
    for d in held:
        (later if d.reason == "duplicate" and d.group.task.task_id not in committed else now).append(d)
    return now, later


def ledger_entries(dropped: list[GroupDecision]) -> dict[str, str]:
    """What the ledger records for dropped groups: id -> reason.  A duplicate records nothing (its
    original's own outcome is the entry)."""
    return {d.group.task.task_id: d.reason for d in dropped if d.reason != "duplicate"}
