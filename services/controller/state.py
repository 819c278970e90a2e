"""What the controller knows: heartbeats and consumer state turned into the law's inputs.  No I/O.

Heartbeat metric names read here (path-like, cumulative unless noted):

- generator: ``generator/groups_started``, ``generator/groups_published``, ``generator/grant_total`` (this boot),
  ``generator/groups_per_s`` (recent), ``generator/concurrency`` (groups per batch now),
  ``generator/pool/<pool>/published``; ``info``: ``boot``, ``pools`` (routed order),
  ``max_batch_groups``; ``state``: running | paused | draining | drained | stopped.
- trainer: ``trainer/version``, ``trainer/groups_trained_total``, ``trainer/groups_dropped_total``,
  ``trainer/pending_groups`` (now), ``trainer/groups_<reason>`` (this process); when present also
  ``trainer/pool/<pool>/groups_<reason>``, ``trainer/generator/<instance>/groups_<reason>`` and
  ``trainer/idle_s``.  Without the per-pool counts the outcomes go in as one total
  (``balance.AGGREGATE``) and the mix is judged on what the generators published per pool.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from bus.protocol import StreamState
from bus.subjects import Subjects
from schemas import Heartbeat
from services.controller.balance import AGGREGATE, REASONS, STALE_HELD, BalanceState
from services.controller.law import GeneratorView, TrainerView

DRAINING = ("draining", "drained")
NO_ADMISSION = 1 << 40  # what a generator with admission off reports as its grant


def trainer_outcomes(metrics: Mapping[str, float]) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """(by pool, by generator) group outcomes from a trainer heartbeat (see the module docstring)."""
    by_pool: dict[str, dict[str, int]] = {}
    by_gen: dict[str, dict[str, int]] = {}
    for key, v in metrics.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "trainer" and parts[3].startswith("groups_"):
            into = by_pool if parts[1] == "pool" else by_gen if parts[1] == "generator" else None
            if into is not None:
                into.setdefault(parts[2], {})[parts[3][7:]] = int(v)
    if not by_pool:
        totals = {r: int(metrics.get(f"trainer/groups_{r}", 0)) for r in REASONS}
        # Without a breakdown a stale group cannot be told from one that went stale while held:
        # counted as held (not against the usable fraction), so over-sampling never feeds on it.
        totals[STALE_HELD] = int(metrics.get("trainer/groups_stale_held", totals["stale"]))
        by_pool[AGGREGATE] = totals
    return by_pool, by_gen


@dataclass
class QueueState:
    """Consumer state of the work the controller routes (from ``Bus.streams``)."""

    backlog: dict[str, int] = field(default_factory=dict)  # pool -> tasks not yet delivered to a generator
    held: dict[str, int] = field(default_factory=dict)  # pool -> tasks delivered, not acked (ack-pending)
    redelivered: dict[str, int] = field(default_factory=dict)  # pool -> tasks delivered more than once
    scored_pending: int = 0  # scored groups the trainer has not pulled yet
    scored_ack_pending: int = 0
    at: float = 0.0

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {"controller/queue/scored/pending": self.scored_pending,
                               "controller/queue/scored/ack_pending": self.scored_ack_pending}
        for p in self.backlog:
            m |= {f"controller/queue/tasks/{p}/pending": self.backlog[p], f"controller/queue/tasks/{p}/ack_pending":
                  self.held.get(p, 0), f"controller/queue/tasks/{p}/redelivered": self.redelivered.get(p, 0)}
        return m


def queue_state(streams: list[StreamState], subjects: Subjects, pools: list[str], now: float) -> QueueState:
    q = QueueState(at=now)
    durables = {subjects.durable("generator", p): p for p in pools}
    for s in streams:
        for c in s.consumers:
            if s.name == subjects.stream("TASKS") and c.name in durables:
                p = durables[c.name]
                q.backlog[p], q.held[p], q.redelivered[p] = c.pending, c.ack_pending, c.redelivered
            elif s.name == subjects.stream("SCORED") and c.name == subjects.durable("trainer"):
                q.scored_pending, q.scored_ack_pending = c.pending, c.ack_pending
    return q


@dataclass
class GeneratorInfo:
    """The latest of one instance's heartbeats, for routing and concurrency decisions."""

    boot: str = ""
    state: str = "running"
    pools: list[str] = field(default_factory=list)
    shares: dict[str, float] = field(default_factory=dict)
    concurrency: int = 0
    max_batch_groups: int = 0
    version: int = -1
    rate: float = 0.0
    ts: float = 0.0


class ControllerState:
    """Heartbeats in; generator and trainer views plus the balance measurements out."""

    def __init__(self, *, tau_s: float = 20.0) -> None:
        self.generators: dict[tuple[str, str], GeneratorView] = {}
        self.info: dict[str, GeneratorInfo] = {}
        self.trainer = TrainerView()
        self.trainer_seen = False
        self.trainer_idle_fraction = math.nan
        self.balance = BalanceState(tau_s=tau_s)
        self.heartbeats: dict[tuple[str, str], Heartbeat] = {}
        self.queues = QueueState()
        self._published_by_boot: dict[tuple[str, str], dict[str, int]] = {}
        self._trainer_seq = -1

    def observe(self, hb: Heartbeat, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.heartbeats[(hb.service, hb.instance)] = hb
        if hb.service == "generator":
            self._observe_generator(hb, now)
        elif hb.service == "trainer":
            self._observe_trainer(hb, now)

    def _observe_generator(self, hb: Heartbeat, now: float) -> None:
        m = hb.metrics
        boot = str(hb.info.get("boot", ""))
        if (hb.instance, boot) not in self.generators:
            # Instance names are unique per replica: a new boot means the earlier ones are gone.
            for (inst, b), old in self.generators.items():
                if inst == hb.instance and b != boot:
                    old.last_seen = 0.0
        g = self.generators.setdefault((hb.instance, boot), GeneratorView(hb.instance, boot))
        g.started = int(m.get("generator/groups_started", g.started))
        g.published = int(m.get("generator/groups_published", g.published))
        g.rate = float(m.get("generator/groups_per_s", g.rate))
        reported = int(m.get("generator/grant_total", 0))
        g.reported_grant = reported if reported < NO_ADMISSION else 0  # admission off: the plan's own record
        if hb.version >= 0:
            g.weights_version = hb.version
        g.draining = hb.state in DRAINING
        g.last_seen = 0.0 if hb.state == "stopped" else now
        pools = [str(p) for p in hb.info.get("pools", [])]
        self.info[hb.instance] = GeneratorInfo(
            boot=boot, state=hb.state, pools=pools, shares=dict(hb.info.get("shares", {})),
            concurrency=int(m.get("generator/concurrency", 0)),
            max_batch_groups=int(hb.info.get("max_batch_groups", m.get("generator/concurrency", 0))),
            version=hb.version, rate=g.rate, ts=hb.ts)
        by_pool = {k.split("/")[2]: int(v) for k, v in m.items() if k.startswith("generator/pool/")
                   and k.endswith("/published")}
        self._published_by_boot[(hb.instance, boot)] = by_pool
        self.balance.observe_generator(hb.instance, hb.ts, started=g.started, published=g.published, boot=boot,
                                       slots=int(m.get("generator/concurrency", 0)), pool=pools[0] if pools else "",
                                       published_by_pool=by_pool)
        totals: Counter[str] = Counter()
        for counts in self._published_by_boot.values():
            totals.update(counts)
        self.balance.observe_published_by_pool(dict(totals))

    def _observe_trainer(self, hb: Heartbeat, now: float) -> None:
        m = hb.metrics
        t = self.trainer
        if hb.seq < self._trainer_seq:
            # A new trainer process: its per-process outcome counters start again from zero.
            self.balance.restart_trainer()
        self._trainer_seq = hb.seq
        t.version = int(m.get("trainer/version", t.version))
        t.dropped_groups = int(m.get("trainer/groups_dropped_total", t.dropped_groups))
        t.trained_groups = int(m.get("trainer/groups_trained_total", t.trained_groups))
        t.last_seen = now
        t.done = hb.state == "done"
        t.pending_groups = int(m.get("trainer/pending_groups", 0))
        self.trainer_seen = True
        self.trainer_idle_fraction = float(m.get("trainer/idle_fraction", math.nan))
        by_pool, by_gen = trainer_outcomes(m)
        idle = m.get("trainer/idle_s")
        self.balance.observe_trainer(hb.ts, trained_total=t.trained_groups, by_pool=by_pool, by_generator=by_gen,
                                     idle_s=float(idle) if idle is not None else None)

    def live_instances(self) -> list[str]:
        return sorted({g.instance for g in self.generators.values() if g.alive and g.last_seen > 0 and not g.draining})

    def views(self) -> list[GeneratorView]:
        return list(self.generators.values())
