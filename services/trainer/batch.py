"""Batch assembly: which scored groups train, which are dropped, and why.  Pure, no I/O.

Per rollout: *stale* when its staleness (optimiser updates between the weights of its stalest
token's version and the trainer's, ``Lineage.staleness``: ``trainer_version - oldest token version``
unless a resumed trainer forked the versions, when samples of the lost lineage count every update
that separates them from the restored model) exceeds ``max_staleness`` (not trained on, counted;
its reward still counts in its group's baseline), *invalid* on a verifier error or
environment failure (not trained on, not in the baseline).  Per group: *duplicate* when its id
was already consumed (a redelivery after a crash), *filtered* when the counted rewards are all
equal (no learning signal: dynamic sampling), *stale* when no rollout is fresh enough, *invalid*
when no rollout is valid.  Every dropped group is recorded with its reason; nothing vanishes.
A kept group can still go stale while it waits for a batch (``requeue_stale``): its outcome
moves from *train* to *stale*, and it is also counted as *stale_held*.  Outcomes are tallied per
pool and per generator as well (``Outcomes``), for the controller's balance accounting.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from schemas import ScoredGroup
from schemas.metric_keys import STALE_HELD
from services.trainer.versions import Lineage


@dataclass
class GroupDecision:
    group: ScoredGroup
    handle: Any  # the delivery, settled by the service once the step is durable
    train_mask: list[bool]  # rollouts trained on
    baseline_mask: list[bool]  # rollouts whose reward counts in the baseline
    staleness: list[int]
    reason: str = "train"  # train | filtered | stale | invalid | duplicate


@dataclass
class Outcomes:
    """Group outcomes (train, filtered, invalid, stale, and the ``stale_held`` part of stale) by
    pool and by generator, counted from zero by this process.  A duplicate is no outcome of its
    own: its original's counts.  A group without a generator id is counted per pool only."""

    by_pool: dict[str, Counter[str]] = field(default_factory=dict)
    by_generator: dict[str, Counter[str]] = field(default_factory=dict)

    def count(self, group: ScoredGroup, outcome: str, n: int = 1) -> None:
        self.by_pool.setdefault(group.task.pool, Counter())[outcome] += n
        if group.generator_id:
            self.by_generator.setdefault(group.generator_id, Counter())[outcome] += n

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

    def offer(self, group: ScoredGroup, handle: Any, *, version: int, consumed: Container[str]) -> GroupDecision:
        gid = group.task.task_id
        staleness = [self.lineage.staleness(version, s.rollout) for s in group.scored]
        valid = [s.valid for s in group.scored]
        fresh = [st <= self.max_staleness for st in staleness]
        train = [v and f for v, f in zip(valid, fresh, strict=True)]
        d = GroupDecision(group, handle, train, list(valid), staleness)
        rewards = {s.reward for s, b in zip(group.scored, valid, strict=True) if b}
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
