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
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from rlbus.bus.protocol import StreamState
from rlbus.bus.subjects import Subjects
from rlbus.observability.logging import get_logger
from rlbus.schemas import Heartbeat
from rlbus.schemas.metric_keys import OUTCOMES, GeneratorKeys, TrainerKeys
from rlbus.services.controller.balance import BalanceState
from rlbus.services.controller.law import GeneratorView, TrainerView

log = get_logger()

DRAINING = ("draining", "drained")
NO_ADMISSION = 1 << 40  # what a generator with admission off reports as its grant
MAX_COUNT = NO_ADMISSION  # a counter beyond this is no count a service keeps (and would overflow a grant)
MAX_CLOCK_SKEW_S = 86_400.0  # a heartbeat stamped further from this clock is timed by its arrival instead
MAX_TOKEN_LEN = 64  # a boot id or pool name (a subject token is at most 64 characters)
# Generator boots kept one by one.  Every boot seen stays in the admission sums (what it published
# occupies the window), but a boot that is gone needs no view of its own: past this many views the
# longest-gone are folded into one account (``ControllerState.retire``), so a flood of heartbeats that
# each name a new boot or instance costs bounded work per heartbeat and per decision.
MAX_GENERATOR_VIEWS = 1024
MAX_SEEN_INSTANCES = 4096  # (service, instance) pairs whose last heartbeat time is kept
# The account of folded boots: its instance has a space, which no subject token (so no heartbeat) has.
RETIRED = ("retired generators", "")


class Readings:
    """The values the controller reads from heartbeats, each checked before use.

    The schema only promises types (a metric is a float, ``info`` is small plain data): a heartbeat
    may still carry NaN, inf, a negative or astronomically large counter, or an ``info`` value of the
    wrong shape.  Each reader below returns the value when it is one the controller can decide on,
    and otherwise the caller's default (what it knew before), logging the first bad value of each
    (instance, name) once: a hostile or broken heartbeat costs a metric, never the controller."""

    def __init__(self) -> None:
        self.skipped = 0  # bad values met, for the controller's heartbeat
        self._warned: set[tuple[str, str]] = set()

    def skip(self, hb: Heartbeat, name: str, value: object, why: str) -> None:
        self.skipped += 1
        key = (f"{hb.service}/{hb.instance}", name)
        if key not in self._warned and len(self._warned) < 10_000:
            self._warned.add(key)
            log.warning("heartbeat_value_skipped", instance=key[0], name=name, value=repr(value)[:80], why=why,
                        fix="find what this service computes for it; the controller keeps its last good value")

    def count(self, hb: Heartbeat, key: str, default: int) -> int:
        """A cumulative counter or a version: a finite whole number in [0, MAX_COUNT]."""
        v = hb.metrics.get(key)
        if v is None:
            return default
        if not math.isfinite(v) or v < 0 or v > MAX_COUNT:
            self.skip(hb, key, v, f"a count must be finite and within [0, {MAX_COUNT}]")
            return default
        return int(v)

    def number(self, hb: Heartbeat, key: str, default: float) -> float:
        """A rate, a duration or a fraction: finite and >= 0."""
        v = hb.metrics.get(key)
        if v is None:
            return default
        if not math.isfinite(v) or v < 0:
            self.skip(hb, key, v, "must be finite and >= 0")
            return default
        return float(v)

    def token(self, hb: Heartbeat, key: str) -> str:
        """A short name from ``info`` (a boot id): '' when absent or unusable."""
        v = hb.info.get(key, "")
        if isinstance(v, str) and len(v) <= MAX_TOKEN_LEN:
            return v
        self.skip(hb, f"info.{key}", v, f"must be a string of at most {MAX_TOKEN_LEN} characters")
        return ""

    def names(self, hb: Heartbeat, key: str) -> list[str]:
        """A list of short names from ``info`` (routed pools): the usable ones."""
        v = hb.info.get(key, [])
        if not isinstance(v, list) or not all(isinstance(p, str) and 0 < len(p) <= MAX_TOKEN_LEN for p in v):
            self.skip(hb, f"info.{key}", v, f"must be a list of names of at most {MAX_TOKEN_LEN} characters")
            return [p for p in v if isinstance(p, str) and 0 < len(p) <= MAX_TOKEN_LEN] if isinstance(v, list) else []
        return list(v)

    def shares(self, hb: Heartbeat, key: str) -> dict[str, float]:
        """Shares per name from ``info``: finite, >= 0 numbers under short names (the others left out)."""
        v = hb.info.get(key, {})
        ok = {p: float(w) for p, w in v.items() if isinstance(p, str) and len(p) <= MAX_TOKEN_LEN
              and isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0} \
            if isinstance(v, dict) else {}
        if not isinstance(v, dict) or len(ok) != len(v):
            self.skip(hb, f"info.{key}", v, "must map names to finite shares >= 0")
        return ok

    def small_int(self, hb: Heartbeat, key: str, default: int) -> int:
        """A whole number of at least 1 from ``info`` (max batch groups), or ``default``."""
        v = hb.info.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= MAX_COUNT:
            self.skip(hb, f"info.{key}", v, f"must be a number in [1, {MAX_COUNT}]")
            return default
        return int(v)

    def ts(self, hb: Heartbeat, now: float) -> float:
        """When it was sent; ``now`` for a stamp further than a day from this clock (the rates would
        otherwise be measured over a made-up interval)."""
        if abs(hb.ts - now) > MAX_CLOCK_SKEW_S:
            self.skip(hb, "ts", hb.ts, f"more than {MAX_CLOCK_SKEW_S:.0f}s from the controller's clock")
            return now
        return hb.ts


def trainer_outcomes(metrics: Mapping[str, float], *, pools: Collection[str] | None = None,
                     generators: Collection[str] | None = None,
                     ) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """(by pool, by generator) group outcomes from a trainer heartbeat's breakdown keys.

    ``pools`` / ``generators``: the names to read (None: any); a breakdown under another name is left
    out.  The controller reads only the run's pools and the generators it heard from: every name it
    reads becomes state it keeps and works through each period, so names a heartbeat makes up (a
    broken or hostile emitter, thousands per heartbeat) must not become state.

    There is no totals-only fallback: the trainer reports every group it judges under its
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
            known = pools if kind == "pool" else generators
            if known is not None and name not in known:
                continue
            if math.isfinite(v) and 0 <= v <= MAX_COUNT:  # a count nobody keeps is left out (see Readings)
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
    rollouts_pending: int = 0  # rollout groups the reward service has not pulled yet
    dead: int = 0  # messages on DEAD (each with its reason)
    at: float = 0.0

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {"controller/queue/scored/pending": self.scored_pending,
                               "controller/queue/scored/ack_pending": self.scored_ack_pending,
                               "controller/queue/rollouts/pending": self.rollouts_pending,
                               "controller/queue/dead/messages": self.dead}
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
            elif s.name == subjects.stream("ROLLOUTS") and c.name == subjects.durable("reward"):
                q.rollouts_pending = c.pending
        if s.name == subjects.stream("DEAD"):
            q.dead = s.messages
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

    def __init__(self, *, tau_s: float = 20.0, pools: Collection[str] | None = None) -> None:
        # The pools whose counts are read (None: any); a generator's or the trainer's count under any
        # other pool name is left out (``trainer_outcomes``), so made-up names never become state.
        self.pools = frozenset(pools) if pools is not None else None
        self.generators: dict[tuple[str, str], GeneratorView] = {}
        self.info: dict[str, GeneratorInfo] = {}
        self.trainer = TrainerView()
        self.trainer_seen = False
        self.trainer_idle_fraction = math.nan
        self.balance = BalanceState(tau_s=tau_s)
        self.seen_at: dict[tuple[str, str], float] = {}  # (service, instance) -> when last heard (0: it stopped)
        self.queues = QueueState()
        self._published_by_boot: dict[tuple[str, str], dict[str, int]] = {}
        self._published_totals: Counter[str] = Counter()  # the sum of _published_by_boot
        self._heard_boots: dict[str, set[str]] = {}  # instance -> boots heard from since its last new boot
        self._trainer_seq = -1
        self._warned_no_breakdown = False
        self.readings = Readings()
        self.outcome_generators: set[str] = set()  # generator names read from the trainer's breakdown

    def observe(self, hb: Heartbeat, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.seen_at[(hb.service, hb.instance)] = 0.0 if hb.state == "stopped" else now
        if len(self.seen_at) > MAX_SEEN_INSTANCES:
            # Instance names come from heartbeats: keep the most recently heard half (the others are
            # not live), so a flood of names costs bounded memory and bounded ``heard_from`` work.
            recent = sorted(self.seen_at.items(), key=lambda kv: kv[1], reverse=True)
            self.seen_at = dict(recent[:MAX_SEEN_INSTANCES // 2])
        if hb.service == "generator":
            self._observe_generator(hb, now)
        elif hb.service == "trainer":
            self._observe_trainer(hb, now)

    def _observe_generator(self, hb: Heartbeat, now: float) -> None:
        r = self.readings
        boot = r.token(hb, GeneratorKeys.INFO_BOOT)
        heard = self._heard_boots.setdefault(hb.instance, set())
        if (hb.instance, boot) not in self.generators:
            # Instance names are unique per replica: a new boot means the earlier ones are gone.  (Only
            # those heard from since the last new boot can still look alive: the work per heartbeat does
            # not grow with the boots seen.)
            for b in heard - {boot}:
                if (old := self.generators.get((hb.instance, b))) is not None:
                    old.last_seen = 0.0
            heard.clear()
        heard.add(boot)
        g = self.generators.setdefault((hb.instance, boot), GeneratorView(hb.instance, boot))
        g.started = r.count(hb, GeneratorKeys.GROUPS_STARTED, g.started)
        g.published = r.count(hb, GeneratorKeys.GROUPS_PUBLISHED, g.published)
        g.rate = r.number(hb, GeneratorKeys.GROUPS_PER_S, g.rate)
        reported = r.count(hb, GeneratorKeys.GRANT_TOTAL, 0)
        g.reported_grant = reported if reported < NO_ADMISSION else 0  # admission off: the plan's own record
        if hb.version >= 0:
            g.weights_version = min(hb.version, MAX_COUNT)
        g.draining = hb.state in DRAINING
        g.last_seen = 0.0 if hb.state == "stopped" else now
        pools = r.names(hb, GeneratorKeys.INFO_POOLS)
        concurrency = r.count(hb, GeneratorKeys.CONCURRENCY, 0)
        ts = r.ts(hb, now)
        self.info[hb.instance] = GeneratorInfo(
            boot=boot, state=hb.state, pools=pools, shares=r.shares(hb, GeneratorKeys.INFO_SHARES),
            concurrency=concurrency,
            max_batch_groups=r.small_int(hb, GeneratorKeys.INFO_MAX_BATCH_GROUPS, max(concurrency, 1)),
            version=hb.version, rate=g.rate, ts=ts)
        by_pool = {}
        for key in hb.metrics:
            pool = GeneratorKeys.parse_pool_published(key)
            if pool is not None and (self.pools is None or pool in self.pools):
                by_pool[pool] = r.count(hb, key, 0)
        # Totals kept up to date by difference: summing every boot's counts per heartbeat grew with the boots.
        self._published_totals.subtract(self._published_by_boot.get((hb.instance, boot), {}))
        self._published_totals.update(by_pool)
        self._published_by_boot[(hb.instance, boot)] = by_pool
        self.balance.observe_generator(hb.instance, ts, started=g.started, published=g.published, boot=boot,
                                       slots=concurrency, pool=pools[0] if pools else "")
        self.balance.observe_published_by_pool(dict(self._published_totals))

    def _observe_trainer(self, hb: Heartbeat, now: float) -> None:
        r = self.readings
        m = hb.metrics
        t = self.trainer
        if hb.seq < self._trainer_seq:
            # A new trainer process: its per-process outcome counters start again from zero.
            self.balance.restart_trainer()
        self._trainer_seq = hb.seq
        t.version = r.count(hb, TrainerKeys.VERSION, t.version)
        t.dropped_groups = r.count(hb, TrainerKeys.GROUPS_DROPPED_TOTAL, t.dropped_groups)
        t.trained_groups = r.count(hb, TrainerKeys.GROUPS_TRAINED_TOTAL, t.trained_groups)
        t.last_seen = now
        t.done = hb.state == "done"
        t.pending_groups = r.count(hb, TrainerKeys.PENDING_GROUPS, 0)
        self.trainer_seen = True
        idle_fraction = m.get(TrainerKeys.IDLE_FRACTION, math.nan)
        self.trainer_idle_fraction = idle_fraction if 0 <= idle_fraction <= 1 else math.nan  # NaN: not measured
        by_pool, by_gen = trainer_outcomes(m, pools=self.pools, generators=self._outcome_generators(m))
        if not by_pool and not self._warned_no_breakdown and any(m.get(TrainerKeys.groups(o), 0) for o in OUTCOMES):
            # A trainer build from before the breakdown: the controller then measures no kept fraction
            # (no over-sampling) and judges the mix on what the generators published.
            self._warned_no_breakdown = True
            log.warning("trainer_outcomes_without_breakdown", instance=hb.instance,
                        fix="run a trainer that reports trainer/pool/<pool>/groups_<outcome> (this build's)")
        idle = r.number(hb, TrainerKeys.IDLE_S, -1.0) if TrainerKeys.IDLE_S in m else -1.0
        self.balance.observe_trainer(r.ts(hb, now), trained_total=t.trained_groups, by_pool=by_pool,
                                     by_generator=by_gen, idle_s=idle if idle >= 0 else None)

    def _outcome_generators(self, metrics: Mapping[str, float]) -> set[str]:
        """The generator names whose outcomes are read from a trainer heartbeat: every one heard from as
        a generator, and others (a trainer may report a generator before the controller hears it, as
        after a controller restart: its counts are then the baseline) up to ``MAX_GENERATOR_VIEWS``
        names, so that made-up names cannot grow the state past that."""
        for key in metrics:
            parsed = TrainerKeys.parse_breakdown(key)
            if parsed is not None and parsed[0] == "generator" and parsed[1] not in self.outcome_generators \
                    and (parsed[1] in self.info or len(self.outcome_generators) < MAX_GENERATOR_VIEWS):
                self.outcome_generators.add(parsed[1])
        return self.outcome_generators

    def heard_from(self, service: str, now: float, within: float) -> int:
        """Instances of ``service`` heard from in the last ``within`` seconds (not stopped)."""
        return sum(1 for (svc, _), at in self.seen_at.items() if svc == service and at > 0 and now - at <= within)

    def live_instances(self) -> list[str]:
        return sorted({g.instance for g in self.generators.values() if g.alive and g.last_seen > 0 and not g.draining})

    def views(self) -> list[GeneratorView]:
        return list(self.generators.values())

    def retire(self, limit: int | None = None) -> tuple[list[tuple[str, str]], list[str]]:
        """Fold the longest-gone boots into the ``RETIRED`` account while more than ``limit`` views
        (``MAX_GENERATOR_VIEWS``) are kept; returns the (instance, boot) keys folded and the instances
        left with no boot at all (forgotten: their info, last heartbeat time and rates).  Only a boot a plan already found silent or
        replaced (``alive`` False: it was drained, its grant taken back) is folded; what it published
        stays in the account, so the admission sums do not change.  A folded boot heard from again
        starts a new view and its groups count twice until it is gone again: fewer admissions, never
        more."""
        limit = MAX_GENERATOR_VIEWS if limit is None else limit
        over = len(self.generators) + (RETIRED not in self.generators) - limit
        if over <= 0:
            return [], []
        gone = sorted((k for k, g in self.generators.items() if not g.alive and k != RETIRED),
                      key=lambda k: self.generators[k].last_seen)[:over]
        if not gone:
            return [], []
        account = self.generators.setdefault(RETIRED, GeneratorView(*RETIRED, alive=False))
        by_pool = self._published_by_boot.setdefault(RETIRED, {})
        for key in gone:
            g = self.generators.pop(key)
            self._heard_boots.get(key[0], set()).discard(key[1])
            n = max(g.published, g.started, g.granted)  # a silent boot's plan left started = granted = published
            account.published += n
            account.started = account.granted = account.published
            for pool, count in self._published_by_boot.pop(key, {}).items():
                by_pool[pool] = by_pool.get(pool, 0) + count
        kept = {inst for inst, _ in self.generators}
        forgotten = sorted({inst for inst, _ in gone} - kept)
        for inst in forgotten:
            self.info.pop(inst, None)
            self._heard_boots.pop(inst, None)
            self.seen_at.pop(("generator", inst), None)
            self.balance.forget_generator(inst)
            self.outcome_generators.discard(inst)
        return gone, forgotten
