"""Control decisions, heartbeats/metrics and dead letters.

A ``Control`` is one auditable decision: an envelope (who it targets, when, why, on which inputs,
its ``seq``) around exactly one typed ``decision``: ``Admit``, ``AssignPools``, ``Concurrency``,
``Evaluate``, ``RunState`` (pause/resume/drain) or ``SetMix``, or a record the controller keeps
about the run itself (``Stall``, ``Divergence``).  Each decision validates its own fields, so a
receiver never casts a loose map of parameters.

Ordering: a receiver applies the decisions of one kind in ``seq`` order and ignores a replayed
older one.  Every issuer (the controller, an operator's ``rlbus control``) takes its ``seq`` from a
``DecisionClock``: microseconds of wall time, but always above every seq the issuer has seen on
the run's CONTROL stream.  A decision issued later therefore carries a larger seq than anything it
could have seen, whoever issued it, and an issuer that restarts or runs beside another can never
void the decisions that follow it (as a per-process counter started at one issuer's start time would).
A seq more than ``MAX_SEQ_AHEAD_S`` ahead of the decoding machine's clock is refused on decode: every
issuer would otherwise have to follow it (a seq of 1e18 would leave wall time behind for good, one
near 2**64 would overflow the next decision's encoding), so it goes to DEAD with the reason instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from rlbus.schemas.base import Message, invalid

# A receiver refuses a Control whose seq (wall-clock microseconds) is further ahead of its own clock
# than this: a day covers any clock skew between issuers worth tolerating; more is a broken clock or
# a forged seq, and following it would move every later decision's seq off wall time for good.
MAX_SEQ_AHEAD_S = 86_400.0


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


# Why the run stopped making progress (``Stall.cause``), as the controller's stall watch tells them apart.
STALL_CAUSES = (
    "trainer_silent",  # no trainer heartbeat
    "no_generator",  # no generator heard from
    "all_generators_paused",  # every live generator paused (by whom: the decision's issuer)
    "all_generators_draining",  # every live generator draining or drained
    "environment_not_answering",  # no environment instance heard from: resets fail, tasks are naked
    "trainer_not_consuming",  # scored groups wait on SCORED, the trainer takes none
    "reward_not_scoring",  # rollouts wait on ROLLOUTS, the reward service scores none
    "no_generator_admitted",  # the admission window is full but nothing in it reaches the trainer
    "no_work_queued",  # the trainer waits and no task is queued (used up, or dead-lettered)
    "generators_not_publishing",  # generators hold tasks and grant but publish nothing
)


@dataclass(frozen=True)
class Stall(Message):
    """The controller's record that the run has made no progress (no group trained or dropped, no new
    version) for ``stalled_s`` seconds while work was waiting, and the likely ``cause``; published on
    ``rl.<run>.control.controller.<instance>.stall`` when a stall is found, when its cause changes and
    when progress resumes (``cause`` empty: cleared)."""

    KIND = "stall"
    cause: str  # one of STALL_CAUSES, or "" once progress resumed
    stalled_s: float = 0.0  # seconds without progress when this record was made
    since: float = 0.0  # wall time of the last progress
    detail: str = ""  # what the controller saw, in words, and what to look at

    def validate(self) -> None:
        if self.cause and self.cause not in STALL_CAUSES:
            raise invalid(self, "cause", f"must be one of {', '.join(STALL_CAUSES)} or '' (cleared)",
                          got=repr(self.cause)[:60])
        if not math.isfinite(self.stalled_s) or self.stalled_s < 0:
            raise invalid(self, "stalled_s", "must be finite and >= 0", got=str(self.stalled_s))


@dataclass(frozen=True)
class Divergence(Message):
    """The controller's record that training reward rose while held-out accuracy fell over the
    policy versions ``from_version``..``to_version`` (the signature of reward hacking or a verifier
    bug: the policy gets better at what the reward pays for, worse at the task); published on
    ``rl.<run>.control.controller.<instance>.divergence`` when the alarm fires and when it clears
    (``firing`` False).  The trends are the change of a least-squares line across the readings of
    the window, in reward units and in accuracy (a fraction)."""

    KIND = "divergence"
    firing: bool
    reward_trend: float = 0.0  # change of the training reward's fitted line across the window
    heldout_trend: float = 0.0  # change of held-out accuracy's fitted line across the window
    from_version: int = 0
    to_version: int = 0
    heldout_readings: int = 0  # held-out rounds in the window
    detail: str = ""  # what the controller saw, in words, and what to check

    def validate(self) -> None:
        for name in ("reward_trend", "heldout_trend"):
            if not math.isfinite(getattr(self, name)):
                raise invalid(self, name, "must be finite", got=str(getattr(self, name)))
        if self.from_version < 0 or self.to_version < self.from_version:
            raise invalid(self, "to_version", "needs 0 <= from_version <= to_version",
                          got=f"{self.from_version}..{self.to_version}")
        if self.heldout_readings < 0:
            raise invalid(self, "heldout_readings", "must be >= 0", got=str(self.heldout_readings))


Decision = Admit | AssignPools | Concurrency | Evaluate | RunState | SetMix | Stall | Divergence
# The action name of each decision: the last token of its CONTROL subject.
Action = Literal["admit", "assign_pools", "concurrency", "evaluate", "pause", "resume", "drain", "set_mix", "stall",
                 "divergence"]


def action_of(decision: Decision) -> Action:
    return decision.state if isinstance(decision, RunState) else decision.KIND  # type: ignore[return-value]


OPERATOR = "operator"  # ``Control.issuer`` of a person's decision (``rlbus control``): no controller lifts it


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
        ahead = self.seq / 1e6 - time.time()
        if ahead > MAX_SEQ_AHEAD_S:
            raise invalid(self, "seq", f"is {ahead:.3g}s ahead of this machine's clock (at most {MAX_SEQ_AHEAD_S:.0f}s "
                          f"allowed): a seq is wall-clock microseconds (DecisionClock); fix the clock of the issuer "
                          f"({self.issuer or 'unknown'}) and publish the decision again", got=str(self.seq)[:40])

    @property
    def action(self) -> Action:
        return action_of(self.decision)

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id`` on CONTROL: a retried publish of one decision is stored once."""
        return f"ctl.{self.target_service}.{self.target_instance}.{self.action}.{self.seq}"


MAX_NAME_LEN = 256  # a service, instance, state or metric name
# Generous: the trainer reports outcomes per pool and per generator (5 per generator), and a metric too
# many would stop an emitter's heartbeat (``Heartbeat`` is validated when built, too).
MAX_METRICS = 32_768
MAX_INFO_DEPTH = 4
MAX_INFO_NODES = 1024  # values and keys, all levels
MAX_INFO_STR = 1024  # characters of one string


def _info_problem(value: Any, *, depth: int, budget: list[int]) -> str:
    """Why ``value`` (a heartbeat's ``info``, or a part of it) is not small plain data, or ''.
    ``budget``: nodes left to visit (shared over the walk, so a wide map is bounded as a deep one)."""
    budget[0] -= 1
    if budget[0] < 0:
        return f"more than {MAX_INFO_NODES} values"
    if isinstance(value, str) and len(value) > MAX_INFO_STR:
        return f"a string of {len(value)} characters (at most {MAX_INFO_STR})"
    if isinstance(value, bytes) and len(value) > MAX_INFO_STR:
        return f"{len(value)} bytes in one value (at most {MAX_INFO_STR})"
    if isinstance(value, (dict, list)):
        if depth >= MAX_INFO_DEPTH:
            return f"nested deeper than {MAX_INFO_DEPTH} levels"
        items = list(value.items()) if isinstance(value, dict) else [(None, v) for v in value]
        for k, v in items:
            if k is not None and not isinstance(k, (str, int)):
                return f"a map key of type {type(k).__name__} (use strings)"
            problem = (_info_problem(k, depth=depth + 1, budget=budget) if k is not None else "") \
                or _info_problem(v, depth=depth + 1, budget=budget)
            if problem:
                return problem
    return ""


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

    def validate(self) -> None:
        """Shape only.  A metric may be NaN or infinite (a loss that diverged, a ratio not measured
        yet is worth seeing in ``rlbus status``); each reader judges the values it uses.  What no
        healthy service sends is refused: a negative seq, a timestamp that is no time, more metrics
        or longer names than a heartbeat needs, and ``info`` nested deeper, larger or with longer
        strings than ``HEARTBEAT_INFO_LIMITS`` (a heartbeat is read by every watcher, twice a second)."""
        if self.seq < 0:
            raise invalid(self, "seq", "must be >= 0", got=str(self.seq))
        if not math.isfinite(self.ts) or self.ts < 0:
            raise invalid(self, "ts", "must be a finite wall time in seconds", got=str(self.ts))
        for name in ("service", "instance", "state"):
            if len(getattr(self, name)) > MAX_NAME_LEN:
                raise invalid(self, name, f"longer than {MAX_NAME_LEN} characters", got=getattr(self, name)[:40])
        if len(self.metrics) > MAX_METRICS:
            raise invalid(self, "metrics", f"more than {MAX_METRICS} metrics; send fewer, coarser ones",
                          got=str(len(self.metrics)))
        long_key = next((k for k in self.metrics if len(k) > MAX_NAME_LEN), None)
        if long_key is not None:
            raise invalid(self, "metrics", f"a metric name is longer than {MAX_NAME_LEN} characters",
                          got=long_key[:40])
        problem = _info_problem(self.info, depth=0, budget=[MAX_INFO_NODES])
        if problem:
            raise invalid(self, "info", problem + "; keep heartbeat info to short names, numbers and small lists")

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
