"""Stall detection: the run made no progress for a while although work was waiting; say why.  No I/O.

Progress is anything that moves the trainer towards its next version: a group trained or dropped,
a new version, a group arriving at the trainer (its pending count) or a generator publishing one.
When none of these moved for ``window`` seconds and the trainer is not done, ``StallWatch.check``
returns a ``Stall`` record naming the likely cause, from what the controller already knows
(heartbeats, consumer state of TASKS / ROLLOUTS / SCORED, the DEAD stream's size, the run states in
force).  The causes are told apart in the order a person would check them, upstream first: the
trainer, the generators (gone, paused, draining), the environment, the trainer's and the reward's
queues, admission, then the task supply.  The service publishes each new record on CONTROL (the
audit trail ``rlbus status`` reads) and logs it; when progress resumes, a record with an empty cause
says so.  A stall is never silent, and never guessed from one heartbeat: the window is long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlbus.schemas.control import Stall
from rlbus.services.controller.law import GeneratorView
from rlbus.services.controller.planner import Planner
from rlbus.services.controller.state import DRAINING


@dataclass
class Evidence:
    """What the diagnosis looks at, as of one check (it also goes into the record's inputs)."""

    now: float
    silent_after: float
    trainer_age_s: float  # seconds since the last trainer heartbeat (inf: never heard)
    version: int
    generators: dict[str, str] = field(default_factory=dict)  # live instance -> reported state
    environments: int = 0  # environment instances heard from lately
    tasks_waiting: int = 0  # TASKS: not yet delivered + delivered, not acked
    tasks_redelivered: int = 0
    rollouts_waiting: int = 0  # ROLLOUTS, for the reward service
    scored_waiting: int = 0  # SCORED, not yet pulled by the trainer
    pending: int = 0  # groups the trainer holds for its next batch
    running: int = 0  # started, not yet published, by live generators
    admitted: int = 0  # grant live generators hold and have not started
    allowed: int = 0
    started: int = 0
    dropped: int = 0
    dead: int = 0  # messages on DEAD

    def inputs(self) -> dict[str, Any]:
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                for k, v in vars(self).items() if k not in ("now", "silent_after")}


def gather(planner: Planner, now: float, silent_after: float) -> Evidence:
    st = planner.state
    q = st.queues
    live_views = [g for g in st.generators.values() if g.alive and g.last_seen > 0 and now - g.last_seen <= silent_after]
    live = {g.instance for g in live_views}
    plan = planner.last_plan
    return Evidence(
        now=now, silent_after=silent_after,
        trainer_age_s=now - st.trainer.last_seen if st.trainer_seen else math.inf, version=st.trainer.version,
        generators={i: info.state for i, info in sorted(st.info.items()) if i in live},
        environments=st.heard_from("environment", now, silent_after),
        tasks_waiting=sum(q.backlog.values()) + sum(q.held.values()), tasks_redelivered=sum(q.redelivered.values()),
        rollouts_waiting=q.rollouts_pending, scored_waiting=q.scored_pending, pending=st.trainer.pending_groups,
        running=sum(g.running for g in live_views), admitted=sum(_unstarted(g) for g in live_views if not g.draining),
        allowed=plan.allowed_total if plan else 0, started=plan.started_total if plan else 0,
        dropped=st.trainer.dropped_groups, dead=q.dead)


def _unstarted(g: GeneratorView) -> int:
    return max(max(g.granted, g.reported_grant) - g.started, 0)


def _holds(planner: Planner, ev: Evidence) -> str:
    """Who holds each live generator: ``gen-0 paused by operator (seq 17...: reason)``."""
    parts = []
    for instance, state in ev.generators.items():
        info = planner.state.info.get(instance)
        ctl = planner.held_by(instance, info.boot if info else "")
        by = f" by {ctl.issuer or 'unknown'} ({ctl.action}, seq {ctl.seq}: {ctl.reason[:60]})" if ctl else ""
        parts.append(f"{instance} {state}{by}")
    return "; ".join(parts)


def diagnose(planner: Planner, ev: Evidence) -> tuple[str, str]:
    """(cause, detail in words) of a stall, upstream first."""
    if ev.trainer_age_s > ev.silent_after:
        heard = "never heard from" if math.isinf(ev.trainer_age_s) else f"silent for {ev.trainer_age_s:.0f}s"
        return "trainer_silent", f"the trainer is {heard} (last version {ev.version}); start or restart it"
    states = set(ev.generators.values())
    if not states:
        return "no_generator", (f"no generator heard from in the last {ev.silent_after:.0f}s while {ev.tasks_waiting} "
                                "tasks wait; start generators or look at why they exit")
    if states == {"paused"}:
        return "all_generators_paused", (f"every live generator is paused: {_holds(planner, ev)}; "
                                         "`rlbus control resume <instance|all>` lifts an operator's pause")
    if states <= set(DRAINING):
        return "all_generators_draining", f"every live generator is draining: {_holds(planner, ev)}"
    if ev.environments == 0:
        return "environment_not_answering", (
            f"no environment instance heard from in the last {ev.silent_after:.0f}s: generators cannot reset tasks "
            f"and nak them ({ev.tasks_redelivered} redelivered now; past max_deliver a task is dead-lettered, DEAD "
            f"holds {ev.dead}); start or restart the environment service")
    if ev.scored_waiting > 0:
        return "trainer_not_consuming", (f"{ev.scored_waiting} scored groups wait on SCORED and the trainer "
                                         f"(version {ev.version}, holding {ev.pending}) takes none; see its log")
    if ev.rollouts_waiting > 0:
        return "reward_not_scoring", (f"{ev.rollouts_waiting} rollout groups wait on ROLLOUTS and none is scored; "
                                      "start the reward service or see its log")
    if ev.tasks_waiting > 0 and ev.admitted == 0 and ev.running == 0:
        return "no_generator_admitted", (
            f"{ev.tasks_waiting} tasks wait but no live generator holds grant: allowed {ev.allowed} vs started "
            f"{ev.started} (trainer version {ev.version}, dropped {ev.dropped}, holding {ev.pending}); groups started "
            "but never trained or dropped hold the staleness window")
    if ev.tasks_waiting == 0 and ev.running == 0:
        return "no_work_queued", (f"no task is queued for the generators and none is in flight while the trainer "
                                  f"waits (holding {ev.pending}); the task set is used up or its tasks were "
                                  f"dead-lettered (DEAD holds {ev.dead})")
    return "generators_not_publishing", (
        f"live generators ({', '.join(f'{i} {s}' for i, s in ev.generators.items())}) hold {ev.admitted} unstarted "
        f"grant and {ev.running} running groups with {ev.tasks_waiting} tasks waiting, but publish nothing; "
        "see the generators' logs (sampling or publishing is stuck)")


class StallWatch:
    """Tracks progress; ``check`` returns a ``Stall`` record when a stall starts, changes cause or ends."""

    def __init__(self, window: float, silent_after: float) -> None:
        self.window = window
        self.silent_after = silent_after
        self.progress: tuple[int, ...] = ()
        self.progress_at = math.nan  # wall time of the last progress (set at the first check)
        self.cause = ""  # the cause reported now ("" = not stalled)
        self.evidence: Evidence | None = None  # of the last record

    def marker(self, planner: Planner) -> tuple[int, ...]:
        st = planner.state
        t = st.trainer
        return (t.version, t.trained_groups, t.dropped_groups, t.pending_groups,
                sum(g.published for g in st.generators.values()))

    def stalled_s(self, now: float) -> float:
        return now - self.progress_at if self.cause else 0.0

    def check(self, planner: Planner, now: float) -> Stall | None:
        marker = self.marker(planner)
        if marker != self.progress or math.isnan(self.progress_at) or planner.state.trainer.done:
            self.progress, self.progress_at = marker, now
            if self.cause:
                self.cause = ""
                return Stall(cause="", stalled_s=0.0, since=now, detail="progress resumed")
            return None
        if now - self.progress_at < self.window:
            return None
        self.evidence = gather(planner, now, self.silent_after)
        cause, detail = diagnose(planner, self.evidence)
        if cause == self.cause:
            return None
        self.cause = cause
        return Stall(cause=cause, stalled_s=round(now - self.progress_at, 3), since=self.progress_at, detail=detail)

    def metrics(self, now: float) -> dict[str, float]:
        return {"controller/stall_s": self.stalled_s(now)}
