"""What the controller knows: heartbeats and consumer state turned into the law's inputs.  No I/O.

Every heartbeat metric read here is named in ``schemas/metric_keys.py`` (the emitters spell them
from there too):

- generator (``GeneratorKeys``): groups started and published, the grant of this boot, the recent
  rate, the concurrency now, published per pool; ``info``: boot, routed pools and shares, max batch;
  ``state``: running | paused | draining | drained | stopped.
- trainer (``TrainerKeys``): version, trained and dropped totals, pending groups, the idle seconds of
  this process, and the outcome of every group it judged (``OUTCOMES`` plus ``STALE_HELD``) per pool
  and per generator, counted by this process from zero.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from bus.protocol import StreamState
from bus.subjects import Subjects
from observability.logging import get_logger
from schemas import Heartbeat
from schemas.metric_keys import OUTCOMES, GeneratorKeys, TrainerKeys
from services.controller.balance import BalanceState
from services.controller.law import GeneratorView, TrainerView

log = get_logger()

DRAINING = ("draining", "drained")
NO_ADMISSION = 1 << 40  # what a generator with admission off reports as its grant


def trainer_outcomes(metrics: Mapping[str, float]) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """(by pool, by generator) group outcomes from a trainer heartbeat's breakdown keys.

    There is no totals-only fallback any more: the trainer reports every group it judges under its
    pool and its generator, so whenever a total (``trainer/groups_<outcome>``) is non-zero the
    breakdown exists too.  Before the first judged group both are absent or zero, and an empty
    breakdown says exactly that (no kept fraction measured yet).  Feeding the totals under a
    pseudo-pool would only add a second, coarser source of the same numbers.  A trainer build from
    before the breakdown is named in the log (``trainer_outcomes_without_breakdown``).
    """
    by_pool: dict[str, dict[str, int]] = {}
    by_gen: dict[str, dict[str, int]] = {}
    for key, v in metrics.items():
        parsed = TrainerKeys.parse_breakdown(key)
        if parsed is not None:
            kind, name, outcome = parsed
            (by_pool if kind == "pool" else by_gen).setdefault(name, {})[outcome] = int(v)
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
        self._warned_no_breakdown = False

    def observe(self, hb: Heartbeat, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.heartbeats[(hb.service, hb.instance)] = hb
        if hb.service == "generator":
            self._observe_generator(hb, now)
        elif hb.service == "trainer":
            self._observe_trainer(hb, now)

    def _observe_generator(self, hb: Heartbeat, now: float) -> None:
        m = hb.metrics
        boot = str(hb.info.get(GeneratorKeys.INFO_BOOT, ""))
        if (hb.instance, boot) not in self.generators:
            # Instance names are unique per replica: a new boot means the earlier ones are gone.
            for (inst, b), old in self.generators.items():
                if inst == hb.instance and b != boot:
                    old.last_seen = 0.0
        g = self.generators.setdefault((hb.instance, boot), GeneratorView(hb.instance, boot))
        g.started = int(m.get(GeneratorKeys.GROUPS_STARTED, g.started))
        g.published = int(m.get(GeneratorKeys.GROUPS_PUBLISHED, g.published))
        g.rate = float(m.get(GeneratorKeys.GROUPS_PER_S, g.rate))
        reported = int(m.get(GeneratorKeys.GRANT_TOTAL, 0))
        g.reported_grant = reported if reported < NO_ADMISSION else 0  # admission off: the plan's own record
        if hb.version >= 0:
            g.weights_version = hb.version
        g.draining = hb.state in DRAINING
        g.last_seen = 0.0 if hb.state == "stopped" else now
        pools = [str(p) for p in hb.info.get(GeneratorKeys.INFO_POOLS, [])]
        concurrency = int(m.get(GeneratorKeys.CONCURRENCY, 0))
        self.info[hb.instance] = GeneratorInfo(
            boot=boot, state=hb.state, pools=pools, shares=dict(hb.info.get(GeneratorKeys.INFO_SHARES, {})),
            concurrency=concurrency, max_batch_groups=int(hb.info.get(GeneratorKeys.INFO_MAX_BATCH_GROUPS, concurrency)),
            version=hb.version, rate=g.rate, ts=hb.ts)
        by_pool = {}
        for key, v in m.items():
            pool = GeneratorKeys.parse_pool_published(key)
            if pool is not None:
                by_pool[pool] = int(v)
        self._published_by_boot[(hb.instance, boot)] = by_pool
        self.balance.observe_generator(hb.instance, hb.ts, started=g.started, published=g.published, boot=boot,
                                       slots=concurrency, pool=pools[0] if pools else "")
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
        t.version = int(m.get(TrainerKeys.VERSION, t.version))
        t.dropped_groups = int(m.get(TrainerKeys.GROUPS_DROPPED_TOTAL, t.dropped_groups))
        t.trained_groups = int(m.get(TrainerKeys.GROUPS_TRAINED_TOTAL, t.trained_groups))
        t.last_seen = now
        t.done = hb.state == "done"
        t.pending_groups = int(m.get(TrainerKeys.PENDING_GROUPS, 0))
        self.trainer_seen = True
        self.trainer_idle_fraction = float(m.get(TrainerKeys.IDLE_FRACTION, math.nan))
        by_pool, by_gen = trainer_outcomes(m)
        if not by_pool and not self._warned_no_breakdown and any(m.get(TrainerKeys.groups(o), 0) for o in OUTCOMES):
            # A trainer build from before the breakdown: the controller then measures no kept fraction
            # (no over-sampling) and judges the mix on what the generators published.
            self._warned_no_breakdown = True
            log.warning("trainer_outcomes_without_breakdown", instance=hb.instance,
                        fix="run a trainer that reports trainer/pool/<pool>/groups_<outcome> (this build's)")
        idle = m.get(TrainerKeys.IDLE_S)
        self.balance.observe_trainer(hb.ts, trained_total=t.trained_groups, by_pool=by_pool, by_generator=by_gen,
                                     idle_s=float(idle) if idle is not None else None)

    def live_instances(self) -> list[str]:
        return sorted({g.instance for g in self.generators.values() if g.alive and g.last_seen > 0 and not g.draining})

    def views(self) -> list[GeneratorView]:
        return list(self.generators.values())
