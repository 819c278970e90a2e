"""Control decisions, heartbeats/metrics and dead letters.

A ``Control`` is one auditable decision: an envelope (who it targets, when, why, on which inputs,
its ``seq``) around exactly one typed ``decision``: ``Admit``, ``AssignPools``, ``Concurrency``,
``Evaluate``, ``RunState`` (pause/resume/drain) or ``SetMix``.  Each decision validates its own
fields, so a receiver never casts a loose map of parameters.

Ordering: a receiver applies the decisions of one kind in ``seq`` order and ignores a replayed
older one.  Every issuer (the controller, an operator's ``rlbus control``) takes its ``seq`` from a
``DecisionClock``: microseconds of wall time, but always above every seq the issuer has seen on
the run's CONTROL stream.  A decision issued later therefore carries a larger seq than anything it
could have seen, whoever issued it, and an issuer that restarts or runs beside another can never
void the decisions that follow it (as a per-process counter started at one issuer's start time did).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas.base import Message, invalid


@dataclass(frozen=True)
class Admit(Message):
    """Cumulative admission of one generator boot: it may have started ``grant_total`` training
    groups in all (the newest grant holds, also when lower), on weights no older than ``min_version``."""

    KIND = "admit"
    boot: str
    grant_total: int
    min_version: int = 0

    def validate(self) -> None:
        if not self.boot:
            raise invalid(self, "boot", "an admission is for one generator boot; name it")
        if self.grant_total < 0:
            raise invalid(self, "grant_total", "must be >= 0", got=str(self.grant_total))
        if self.min_version < 0:
            raise invalid(self, "min_version", "must be >= 0", got=str(self.min_version))


@dataclass(frozen=True)
class AssignPools(Message):
    """The training pools a generator takes tasks from, in priority order, and the share of its
    starts per pool (empty: the first pool that has work)."""

    KIND = "assign_pools"
    pools: list[str]
    shares: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        if not self.pools or len(set(self.pools)) != len(self.pools) or not all(self.pools):
            raise invalid(self, "pools", "must be a non-empty list of distinct pool names", got=repr(self.pools)[:80])
        for pool, share in self.shares.items():
            if pool not in self.pools:
                raise invalid(self, "shares", f"names pool {pool!r}, which is not among 'pools'", got=repr(self.pools))
            if not math.isfinite(share) or share < 0:
                raise invalid(self, "shares", f"share of {pool!r} must be finite and >= 0", got=str(share))


@dataclass(frozen=True)
class Concurrency(Message):
    """The most groups a generator samples in one batch."""

    KIND = "concurrency"
    max_groups: int

    def validate(self) -> None:
        if self.max_groups < 1:
            raise invalid(self, "max_groups", "must be >= 1", got=str(self.max_groups))


@dataclass(frozen=True)
class Evaluate(Message):
    """The record of a held-out round: ``tasks`` tasks scheduled at policy ``version``."""

    KIND = "evaluate"
    version: int
    tasks: int

    def validate(self) -> None:
        if self.version < 0:
            raise invalid(self, "version", "must be >= 0", got=str(self.version))
        if self.tasks < 0:
            raise invalid(self, "tasks", "must be >= 0", got=str(self.tasks))


@dataclass(frozen=True)
class RunState(Message):
    """Pause, resume or drain a generator (drain: finish what it holds, start nothing more, give
    back its grant).  With ``boot`` set it applies to that boot only, so a restarted replica
    ignores what was decided about its predecessor."""

    KIND = "run_state"
    state: Literal["pause", "resume", "drain"]
    boot: str = ""

    def validate(self) -> None:
        # The decoder checks the Literal; a decision built in Python (``rlbus control``) is checked here.
        if self.state not in ("pause", "resume", "drain"):
            raise invalid(self, "state", "must be one of pause, resume, drain", got=repr(self.state)[:40])


@dataclass(frozen=True)
class SetMix(Message):
    """An operator's request to the controller: a new target mix between the training pools."""

    KIND = "set_mix"
    mix: dict[str, float]

    def validate(self) -> None:
        if not self.mix or any(not math.isfinite(x) or x < 0 for x in self.mix.values()) \
                or sum(self.mix.values()) <= 0:
            raise invalid(self, "mix", "needs finite, non-negative shares and at least one positive",
                          got=repr(self.mix)[:80])


Decision = Admit | AssignPools | Concurrency | Evaluate | RunState | SetMix
# The action name of each decision: the last token of its CONTROL subject.
Action = Literal["admit", "assign_pools", "concurrency", "evaluate", "pause", "resume", "drain", "set_mix"]


def action_of(decision: Decision) -> Action:
    return decision.state if isinstance(decision, RunState) else decision.KIND  # type: ignore[return-value]


class DecisionClock:
    """The one rule for ``Control.seq``: wall-clock microseconds, kept above every seq seen."""

    def __init__(self) -> None:
        self.last = 0

    def observe(self, seq: int) -> None:
        """A decision seen on the CONTROL stream (any issuer): later ones must sort after it."""
        self.last = max(self.last, seq)

    def next(self, now: float | None = None) -> int:
        self.last = max(int((time.time() if now is None else now) * 1e6), self.last + 1)
        return self.last


@dataclass(frozen=True)
class Control(Message):
    """One auditable decision: the typed ``decision``, whom it targets, why, and on what inputs."""

    KIND = "control"
    VERSION = 2  # v1 carried an untyped ``params`` map instead of ``decision``
    seq: int
    decision: Decision
    target_service: str
    target_instance: str = "all"
    reason: str = ""
    inputs: dict[str, Any] = field(default_factory=dict)
    issued_at: float = 0.0
    issuer: str = ""  # e.g. "controller-0", "operator"

    def validate(self) -> None:
        if self.seq < 0:
            raise invalid(self, "seq", "must be >= 0", got=str(self.seq))

    @property
    def action(self) -> Action:
        return action_of(self.decision)

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id`` on CONTROL: a retried publish of one decision is stored once."""
        return f"ctl.{self.target_service}.{self.target_instance}.{self.action}.{self.seq}"


@dataclass(frozen=True)
class Heartbeat(Message):
    """Periodic liveness + metrics of one service instance (path-like metric names)."""

    KIND = "heartbeat"
    service: str
    instance: str
    seq: int
    ts: float
    state: str = "running"
    version: int = -1
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id`` on METRICS (the wall-clock second keeps a restarted instance's seq 1 apart)."""
        return f"hb.{self.service}.{self.instance}.{self.seq}.{int(self.ts)}"


@dataclass(frozen=True)
class DeadLetter(Message):
    """A message that could not be processed, kept byte-for-byte with the reason."""

    KIND = "dead_letter"
    origin_subject: str
    error: str
    reason: str
    data: bytes
    deliveries: int = 1
    headers: dict[str, str] = field(default_factory=dict)
    service: str = ""
    stream_seq: int = 0
    ts: float = 0.0
