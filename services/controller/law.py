"""The control law: pure functions from observed state to decisions.  No I/O.

The same code runs in the controller service and in ``bench/controller_sim.py``; the measurements
it feeds on (rates, kept fractions) come from ``balance.py``.

Admission (bounded staleness).  In groups: a new group may start only while
``accepted + running < (V + max_staleness + 1) * B`` where V is the trainer's version (batches
consumed) and B the groups per batch.  ``accepted + running = started - dropped`` (dropped =
zero-variance, stale or invalid groups, which free their slot), so the cumulative number of
groups all generators may have started is ``(V + s + 1) * B + dropped``.  Grants are cumulative
per generator boot, so a lost or repeated control message is harmless, and a silent generator's
unstarted grant is reclaimed (the plan's reason names it).

Over-sampling.  The window above counts groups that will be *trained*, but a share ``1 - u`` of
the groups still running never will: filtered (zero-variance, invalid) or back too late (the long
tail).  A window counted in started groups then holds only ``u`` of it in trainable work, and the
trainer waits.  ``plan_balanced`` lets ``1/u`` as many start: expected trainable work in flight
stays ``(s + 1) * B`` minus what the trainer already holds (``pending``), with ``u`` an upper
confidence bound (fewer extras when unsure), measured without the groups that went stale while
held (counting those would feed back: more admitted, more stale, more admitted).  When groups
finish in start order and the filter keeps its share exactly, no kept group is ever trained beyond
the bound (``tests/unit/test_controller_balance.py`` checks it); when more survive than expected,
the surplus is refused by the trainer as stale (counted, its slot freed), never trained beyond the
bound.  Unlike the plain bound, the over-sampled total can dip below what was already granted (a
run of kept groups raises ``pending``); grants never shrink, new ones wait.

Weights lag.  The window assumes a group samples with the trainer's current weights; a generator
still on ``w < V`` may only use the window as it stood at ``w`` (B groups less per version behind),
which right after a version bump holds the freed budget until the new weights arrive.

Rate-aware split.  ``plan_balanced`` hands each next group to the live generator that would finish
it first (``finish_time``: its latency relative to its pool's usual one if a slot is free, plus the
queue ahead of it otherwise, divided by the share of its groups that arrive in time), so work in
hand follows each generator's measured speed: a slow generator holds little, and its samples age
less.  Comparing within a pool keeps long tasks from being starved in favour of short ones.

Pool routing.  ``assign_routes`` stacks live generators, by what they produce, over the pools' shares
of the needed capacity (target mix plus the trained mix's deficit since the target was set, divided
by each pool's kept fraction); each generator gets its pools in priority order and, where it
straddles two pools, the share of its starts each should get (``assign_pools`` is the order only).

Concurrency.  ``plan_concurrency`` caps the groups a generator samples at once by its latency
relative to the typical one: a generator k times slower holds each group k times longer, so with a
full batch it would lock k times its share of the staleness window in samples that age while it
holds them.  Latency, not rate, decides, because a smaller batch lowers a generator's rate (a cap
judged by rate would feed on itself) but barely its latency.

Silent and draining generators.  ``mark_silent`` takes back what a generator that stopped
heartbeating held; the plan that notices names it in its reason and in ``lost``.  A generator that
reports it is draining (it dropped its own unstarted grant) gets nothing more; what it started still
counts until it is published.

Pausing.  ``pause_decision``: generators are paused once the trainer reports it is done (their
grants would only produce groups nobody trains) and resumed when a trainer runs again.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GeneratorView:
    instance: str
    boot: str
    started: int = 0  # groups started by this boot (cumulative)
    published: int = 0
    granted: int = 0  # cumulative groups this boot may start
    last_seen: float = 0.0
    rate: float = 0.0  # groups/s, smoothed
    alive: bool = True
    weights_version: int | None = None  # policy version it samples with (heartbeat); None = unknown
    draining: bool = False  # it reported draining/drained: it starts nothing more and dropped its unstarted grant
    reported_grant: int = 0  # the grant it last reported holding (heartbeat; 0 = unknown): counts until it drops

    @property
    def outstanding(self) -> int:
        return max(self.granted - self.started, 0)

    @property
    def running(self) -> int:
        """Started, not yet published."""
        return max(self.started - self.published, 0)


@dataclass
class TrainerView:
    version: int = 0
    dropped_groups: int = 0  # zero-variance + stale + invalid, cumulative
    trained_groups: int = 0
    last_seen: float = 0.0
    done: bool = False  # reached its max_steps: the final version gets evaluated too
    pending_groups: int = 0  # accepted, not yet committed: held for the next batch + the batch in training


@dataclass
class AdmissionPlan:
    allowed_total: int  # cumulative groups all generators may have started
    started_total: int
    grants: dict[tuple[str, str], int] = field(default_factory=dict)  # (instance, boot) -> cumulative grant
    reason: str = ""
    trained_bound: int = 0  # (V+s+1)*B + dropped: the window in groups that will be trained
    oversample: int = 0  # allowed_total - trained_bound: starts expected to be filtered out or late
    lost: list[str] = field(default_factory=list)  # generators this plan found silent (re-planned without them)
    reclaimed: dict[str, int] = field(default_factory=dict)  # instance -> unstarted groups taken back this plan


def allowed_started(trainer: TrainerView, *, batch_groups: int, max_staleness: int) -> int:
    return (trainer.version + max_staleness + 1) * batch_groups + trainer.dropped_groups


def mark_silent(generators: Sequence[GeneratorView], *, now: float, silent_after: float) -> list[str]:
    """Update ``alive``; take back what a silent generator holds.  Returns a note per newly silent one."""
    notes = []
    for g in generators:
        alive = now - g.last_seen <= silent_after
        if not alive:
            if g.alive:
                notes.append(f"{g.instance}/{g.boot} silent {now - g.last_seen:.1f}s: took back {g.outstanding} "
                             f"unstarted, {g.running} unpublished (redelivered)")
            # A lost generator's unpublished groups come back as redelivered tasks and are started
            # again elsewhere; only what it published still occupies the window.  (If it was merely
            # partitioned, its late duplicates are deduped by msg id and by the trainer.)
            g.granted = g.started = g.published
            g.reported_grant = 0
        g.alive = alive
    return notes


def _silent_reason(notes: list[str], generators: Sequence[GeneratorView]) -> str:
    lost = sum(not g.alive for g in generators)
    if notes:
        return f"; re-planned without {len(notes)} newly silent: " + "; ".join(notes)
    return f"; silent={lost}" if lost else ""


def plan_admission(
    generators: list[GeneratorView], trainer: TrainerView, *, batch_groups: int, max_staleness: int,
    now: float, silent_after: float, max_outstanding: int,
) -> AdmissionPlan:
    """Hand out the admission budget; mutates ``generators`` (alive flags, grants)."""
    allowed = allowed_started(trainer, batch_groups=batch_groups, max_staleness=max_staleness)
    notes = mark_silent(generators, now=now, silent_after=silent_after)
    committed = sum(max(g.granted, g.started) for g in generators)
    available = max(allowed - committed, 0)
    live = [g for g in generators if g.alive]
    # Water-filling: the least-loaded live generator gets the next group, so capacity follows
    # whoever is actually draining its grant.
    while available > 0 and live:
        g = min(live, key=lambda x: (x.outstanding, x.instance))
        if g.outstanding >= max_outstanding:
            break
        g.granted = max(g.granted, g.started) + 1
        available -= 1
    started_total = sum(g.started for g in generators)
    reason = (f"allowed=(V={trainer.version}+s={max_staleness}+1)*B={batch_groups}+dropped={trainer.dropped_groups}"
              f"={allowed}; started={started_total}; live={len(live)}" + _silent_reason(notes, generators))
    return AdmissionPlan(allowed_total=allowed, started_total=started_total,
                         grants={(g.instance, g.boot): g.granted for g in generators}, reason=reason,
                         trained_bound=allowed, lost=[n.split(" ", 1)[0] for n in notes])


def oversample_extra(trainer: TrainerView, *, batch_groups: int, max_staleness: int, kept_fraction: float,
                     max_factor: float = 4.0) -> int:
    """Groups that may start beyond the trained window because ``1 - k`` of those running get filtered.

    Trainable work in flight, ``pending + k * running``, stays within ``(s + 1) * B`` when
    ``started <= (V + s + 1) * B + dropped + extra`` with ``extra = ((s + 1) * B - pending) * (1/k - 1)``.
    ``k`` is clamped to ``[1/max_factor, 1]``; a non-finite ``k`` means no measurement: no extra.
    """
    if max_factor < 1.0:
        raise ValueError(f"max_factor={max_factor} must be >= 1 (1 = no over-sampling)")
    if not math.isfinite(kept_fraction):
        return 0
    k = min(max(kept_fraction, 1.0 / max_factor), 1.0)
    room = max((max_staleness + 1) * batch_groups - trainer.pending_groups, 0)
    return math.floor(room * (1.0 / k - 1.0) + 1e-9)


@dataclass(frozen=True)
class Speed:
    """How fast one generator turns a granted group into a usable one (``Signals.generator_speeds``)."""

    rate: float  # groups published per second while it had work
    latency_s: float = math.nan  # mean seconds from start to publish (Little's law: running / rate)
    slots: int = 0  # groups it runs at once (its max batch); 0 = unknown
    fresh: float = 1.0  # share of its groups that arrive in time (not late-stale)
    pool: str = ""  # the pool it mostly samples (its first routed pool): latencies compare within a pool


def _speeds(live: Sequence[GeneratorView], speeds: Mapping[str, Speed] | None) -> list[Speed]:
    """One ``Speed`` per live generator: an unmeasured one is assumed typical (the median of the
    measured ones; equal rates if none is measured, which makes the split the plain water-filling)."""
    if speeds is None:
        speeds = {g.instance: Speed(rate=g.rate) for g in live if g.rate > 0}
    known = [speeds[g.instance] for g in live if g.instance in speeds]

    def median(xs: list[float], default: float) -> float:
        xs = sorted(x for x in xs if math.isfinite(x) and x > 0)
        return xs[len(xs) // 2] if xs else default

    # Latency unknown: counts as typical of whatever pool it is on (see ``finish_time``).
    typical = Speed(rate=median([k.rate for k in known], 1.0), slots=int(median([float(k.slots) for k in known], 0.0)))
    return [speeds.get(g.instance, typical) for g in live]


SLOW_FACTOR = 2.0  # a generator this many times slower than the pool's reference latency counts as slow


def reference_latency(speeds: Sequence[Speed]) -> dict[str, float]:
    """Per pool, the lower median of the measured latencies: with two generators, the healthy one."""
    by_pool: dict[str, list[float]] = {}
    for sp in speeds:
        if math.isfinite(sp.latency_s) and sp.latency_s > 0:
            by_pool.setdefault(sp.pool, []).append(sp.latency_s)
    return {p: sorted(xs)[(len(xs) - 1) // 2] for p, xs in by_pool.items()}


def unstarted_cap(sp: Speed, reference: Mapping[str, float], max_outstanding: int) -> int:
    """Most unstarted groups one generator may hold: one batch (its slots) when it is slow (more than
    ``SLOW_FACTOR`` times the reference latency of its pool), else ``max_outstanding``.  A slow
    generator's queue would only wait behind its running batch while the window counts it as in
    flight, and keep the fast ones from that budget."""
    ref = reference.get(sp.pool)
    slow = ref is not None and math.isfinite(sp.latency_s) and sp.latency_s > SLOW_FACTOR * ref
    return max(min(max_outstanding, sp.slots), 1) if slow and sp.slots > 0 else max_outstanding


def finish_time(g: GeneratorView, sp: Speed, typical_latency_s: float | None = None) -> float:
    """How soon one more group granted to ``g`` would be published and usable (smaller = sooner).

    With ``typical_latency_s`` (the latency usual on ``sp.pool``) and ``sp.slots``: in units of that
    typical latency, a free slot starts the group now, else it queues behind
    ``running + unstarted + 1 - slots`` groups drained ``slots`` at a time; an unmeasured latency
    counts as typical.  Comparing within a pool makes generators on a pool of long tasks as eligible
    as those on short ones: the mix is ``assign_pools``'s business, and favouring short tasks here
    would bias training towards them.  Without them: seconds, ``(running + unstarted + 1) / rate``
    (a rate measured at low load says nothing about free slots, so this is the fallback).
    """
    work = g.running + g.outstanding
    fresh = min(max(sp.fresh, 0.05), 1.0)
    if typical_latency_s is not None and sp.slots > 0:
        rel = sp.latency_s / typical_latency_s if math.isfinite(sp.latency_s) and sp.latency_s > 0 else 1.0
        return rel * (1.0 + max(work + 1 - sp.slots, 0) / sp.slots) / fresh
    return (work + 1) / (max(sp.rate, 1e-6) * fresh)


def _typical_latency(speeds: Sequence[Speed]) -> dict[str, float]:
    by_pool: dict[str, list[float]] = {}
    for sp in speeds:
        if math.isfinite(sp.latency_s) and sp.latency_s > 0:
            by_pool.setdefault(sp.pool, []).append(sp.latency_s)
    return {p: sorted(xs)[len(xs) // 2] for p, xs in by_pool.items()}


def plan_balanced(
    generators: list[GeneratorView], trainer: TrainerView, *, batch_groups: int, max_staleness: int,
    now: float, silent_after: float, max_outstanding: int, speeds: Mapping[str, Speed] | None = None,
    kept_fraction: float = 1.0, max_oversample: float = 4.0, hold_for_weights: bool = True,
) -> AdmissionPlan:
    """``plan_admission`` with over-sampling and a split by generator speed; mutates ``generators``.

    ``speeds``: per instance (``Signals.generator_speeds``); absent = ``Speed(rate=g.rate)``.
    ``kept_fraction``: the conservative share of started groups that will be usable
    (``Signals.usable_upper_for(mix)``); 1.0 turns over-sampling off.  ``hold_for_weights``: a
    generator on older weights than the trainer's only gets the window as it stood at its version
    (``GeneratorView.weights_version``; fewer stale drops, but the budget freed by a version bump
    waits for the new weights: in the simulator that pays with over-sampling on and costs trainer
    time with it off).  A live generator holding more unstarted grant than ``unstarted_cap`` (it
    slowed down while holding a queue) has the excess taken back (``reclaimed``); that budget goes
    to others only once the generator reports holding less (``reported_grant``), so nothing is counted
    twice.  Invariants: ``sum(max(grant, reported grant)) <= allowed_total``, each live generator's
    unstarted grant ``<= max_outstanding``, grants shrink only by taking back unstarted groups.
    """
    notes = mark_silent(generators, now=now, silent_after=silent_after)
    for g in generators:
        if g.draining:
            g.granted = g.started  # it dropped its unstarted grant itself before reporting draining
    bound = allowed_started(trainer, batch_groups=batch_groups, max_staleness=max_staleness)
    extra = oversample_extra(trainer, batch_groups=batch_groups, max_staleness=max_staleness,
                             kept_fraction=kept_fraction, max_factor=max_oversample)
    allowed = bound + extra
    live = sorted((g for g in generators if g.alive and not g.draining), key=lambda g: (g.instance, g.boot))
    speed = _speeds(live, speeds)
    reference = reference_latency(speed)
    caps = [unstarted_cap(sp, reference, max_outstanding) for sp in speed]
    reclaimed = _take_back_excess(live, caps)
    committed = sum(max(g.granted, g.started, g.reported_grant) for g in generators)
    # A generator still on weights ``w < V`` samples groups up to ``V - w`` versions staler than the
    # window assumes, so it may only use the window as it stood at ``w``: B groups less per version
    # behind.  (Right after a version bump that holds the freed budget until the new weights arrive.)
    held_back = [_versions_behind(g, trainer, max_staleness) * batch_groups if hold_for_weights else 0 for g in live]
    handout = _Handout(live, speed, caps, held_back, available=max(allowed - committed, 0))
    handout.one_each(max_outstanding)
    handout.by_finish_time()
    started_total = sum(g.started for g in generators)
    split = ", ".join(f"{g.instance} {sp.latency_s:.1f}s/{sp.slots}:{g.running}+{g.outstanding}"
                      for g, sp in list(zip(live, speed, strict=True))[:8])
    reason = (f"allowed=(V={trainer.version}+s={max_staleness}+1)*B={batch_groups}+dropped={trainer.dropped_groups}"
              f"={bound} +oversample {extra} (usable<={min(max(kept_fraction, 0.0), 1.0):.2f})={allowed}; "
              f"started={started_total}; live={len(live)} by finish time (latency/slots:running+unstarted): {split}"
              + "".join(f"; took back {n} unstarted from {i} (slow: more than one batch unstarted)"
                        for i, n in reclaimed.items())
              + _silent_reason(notes, generators))
    return AdmissionPlan(allowed_total=allowed, started_total=started_total,
                         grants={(g.instance, g.boot): g.granted for g in generators}, reason=reason,
                         trained_bound=bound, oversample=extra, lost=[n.split(" ", 1)[0] for n in notes],
                         reclaimed=reclaimed)


def _take_back_excess(live: Sequence[GeneratorView], caps: Sequence[int]) -> dict[str, int]:
    """Cut each live generator's unstarted grant to its cap; returns what was taken back, per instance."""
    reclaimed = {}
    for g, cap in zip(live, caps, strict=True):
        if g.outstanding > cap:
            reclaimed[g.instance] = g.outstanding - cap
            g.granted = g.started + cap
    return reclaimed


def _versions_behind(g: GeneratorView, trainer: TrainerView, max_staleness: int) -> int:
    """Versions ``g``'s weights lag the trainer's (0 when unknown), at most the whole window."""
    w = g.weights_version
    return 0 if w is None else min(max(trainer.version - w, 0), max_staleness + 1)


class _Handout:
    """``plan_balanced``'s split: ``available`` groups to ``live`` generators, one at a time.

    ``held_back[i]``: the part of the budget generator ``i`` may not use (its weights lag); it takes
    a group only while more than that is available.  Generators compare by ``finish_time`` in
    pool-relative latencies when every one's concurrency is known, else by rate.
    """

    def __init__(self, live: list[GeneratorView], speed: list[Speed], caps: list[int], held_back: list[int], *,
                 available: int) -> None:
        self.live, self.speed, self.caps, self.held_back = live, speed, caps, held_back
        self.available = available
        self.typical = _typical_latency(speed)
        self.relative = bool(speed) and all(sp.slots > 0 for sp in speed)

    def finish(self, i: int) -> float:
        sp = self.speed[i]
        return finish_time(self.live[i], sp, self.typical.get(sp.pool, sp.latency_s) if self.relative else None)

    def grant_one(self, g: GeneratorView) -> None:
        g.granted = max(g.granted, g.started) + 1
        self.available -= 1

    def one_each(self, max_outstanding: int) -> None:
        """A generator with nothing in hand gets one group first, so its speed keeps being measured
        (a slowed generator that recovers is seen to recover)."""
        for i, g in enumerate(self.live):
            if self.available > self.held_back[i] and g.running + g.outstanding == 0 and max_outstanding >= 1:
                self.grant_one(g)

    def by_finish_time(self) -> None:
        """Each next group to whoever would finish it first: work in hand ends up proportional to
        speed, and a slow generator holds little, so its samples do not age."""
        heap = [(self.finish(i), i) for i, g in enumerate(self.live) if g.outstanding < self.caps[i]]
        heapq.heapify(heap)
        while self.available > 0 and heap:
            _, i = heapq.heappop(heap)
            g = self.live[i]
            if self.available <= self.held_back[i]:
                continue  # stays out for this plan: the budget only shrinks from here
            self.grant_one(g)
            if g.outstanding < self.caps[i]:
                heapq.heappush(heap, (self.finish(i), i))


@dataclass(frozen=True)
class Route:
    """Where one generator samples: ``pools`` in priority order (it pulls from the first with work),
    ``shares`` the fraction of its starts each of its stacked pools should get (sums to 1)."""

    pools: list[str]
    shares: dict[str, float]


@dataclass
class RoutingPlan:
    routes: dict[str, Route]  # per live generator instance
    need: dict[str, float]  # each pool's share of the capacity needed (what the generators were stacked over)
    reason: str = ""


def assign_routes(
    generators: Sequence[GeneratorView], target_mix: Mapping[str, float], trained_by_pool: Mapping[str, int],
    backlog_by_pool: Mapping[str, int], *, rates: Mapping[str, float] | None = None,
    kept_by_pool: Mapping[str, float] | None = None, cost_by_pool: Mapping[str, float] | None = None,
    current: Mapping[str, Sequence[str]] | None = None, catch_up_groups: float = 128.0, fallback: bool = True,
) -> RoutingPlan:
    """Pools for each live generator, in priority order, and its share of starts per pool.

    ``trained_by_pool``: groups trained *since the target took effect* (``BalanceState.trained_since_target``):
    the deficit ``target * total - trained`` is the integral term, made up over ``catch_up_groups``
    future groups.  A pool with an empty backlog gets no capacity while another has work.
    ``kept_by_pool`` / ``cost_by_pool`` (generator-seconds per group) scale the capacity a pool needs
    per trained group; unknown = 1.  ``current`` keeps generators where they are when shares barely
    move (they are stacked in their current pool's order).  With ``fallback`` every other pool with
    work follows, so a generator whose pools run dry keeps sampling.
    """
    pools = sorted(p for p, w in target_mix.items() if w > 0)
    if not pools:
        raise ValueError(f"target_mix {dict(target_mix)} has no pool with a positive share")
    if catch_up_groups <= 0:
        raise ValueError(f"catch_up_groups={catch_up_groups} must be > 0")
    total_w = sum(target_mix[p] for p in pools)
    target = {p: target_mix[p] / total_w for p in pools}
    with_work = [p for p in pools if backlog_by_pool.get(p, 1) > 0]
    need = _capacity_need(pools, target, trained_by_pool, with_work, kept_by_pool or {}, cost_by_pool or {},
                          catch_up_groups)
    reason = ("need " + ", ".join(f"{p} {need[p]:.2f}" for p in pools) + " (target "
              + ", ".join(f"{p} {target[p]:.2f}" for p in pools) + "; trained since target "
              + ", ".join(f"{p} {trained_by_pool.get(p, 0)}" for p in pools)
              + (f"; no backlog: {', '.join(p for p in pools if p not in with_work)}" if len(with_work) < len(pools) else "")
              + ")")
    live = [g for g in generators if g.alive and not g.draining]
    if not live:
        return RoutingPlan({}, need, reason + "; no live generator")
    speed = _stacking_speeds(live, rates)

    def order(g: GeneratorView) -> tuple[int, str]:
        mine = list((current or {}).get(g.instance, ()))
        return (pools.index(mine[0]) if mine and mine[0] in pools else len(pools), g.instance)

    live.sort(key=order)
    return RoutingPlan(_stack(live, speed, need, pools, backlog_by_pool if fallback else None), need, reason)


def _capacity_need(pools: list[str], target: Mapping[str, float], trained_by_pool: Mapping[str, int],
                   with_work: list[str], kept_by_pool: Mapping[str, float], cost_by_pool: Mapping[str, float],
                   catch_up_groups: float) -> dict[str, float]:
    """Each pool's share of the generator capacity needed: the target plus the trained mix's deficit
    (spread over ``catch_up_groups``), none for a pool without backlog while another has some,
    scaled by cost and by 1 / kept fraction, normalised."""
    n = sum(max(trained_by_pool.get(p, 0), 0) for p in pools)
    want = {p: max(target[p] + (target[p] * n - trained_by_pool.get(p, 0)) / catch_up_groups, 0.0) for p in pools}
    if with_work:
        want = {p: want[p] if p in with_work else 0.0 for p in pools}
        if sum(want.values()) <= 0:
            want = {p: target[p] if p in with_work else 0.0 for p in pools}
    elif sum(want.values()) <= 0:
        want = dict(target)
    need = {p: want[p] * cost_by_pool.get(p, 1.0) / max(kept_by_pool.get(p, 1.0), 0.05) for p in pools}
    total_need = sum(need.values())
    return {p: x / total_need for p, x in need.items()}


def _stacking_speeds(live: Sequence[GeneratorView], rates: Mapping[str, float] | None) -> dict[str, float]:
    """What each generator produces, to stack by (its share of the starts decides the mix), not what it
    could; an unmeasured one counts as typical, one that produces nothing as a sliver."""
    given = {g.instance: g.rate for g in live if g.rate > 0} if rates is None else rates
    known = {i: r for i, r in given.items() if math.isfinite(r) and r >= 0}
    positive = sorted(r for r in known.values() if r > 0)
    typical = positive[len(positive) // 2] if positive else 1.0
    floor = 0.02 * (positive[-1] if positive else 1.0)
    return {g.instance: max(known.get(g.instance, typical), floor) for g in live}


def _stack(live: Sequence[GeneratorView], speed: Mapping[str, float], need: Mapping[str, float],
           pools: list[str], fallback_backlog: Mapping[str, int] | None) -> dict[str, Route]:
    """Lay the generators, in ``live``'s order and each as wide as its share of the speed, over the
    pools' shares of the need; each gets the pools it overlaps, the majority first, then (with a
    ``fallback_backlog``) every other pool that has work."""
    total_speed = sum(speed.values())
    edges, acc = [], 0.0
    for p in pools:
        acc += need[p]
        edges.append((p, acc - need[p], acc))
    out: dict[str, Route] = {}
    lo = 0.0
    for g in live:
        width = speed[g.instance] / total_speed
        hi = lo + width
        overlap = [(min(hi, b) - max(lo, a), p) for p, a, b in edges if min(hi, b) - max(lo, a) > 1e-9]
        # Majority pool first; a straddling generator's priority follows the bigger share.
        overlap.sort(key=lambda x: (-x[0], pools.index(x[1])))
        mine = [p for _, p in overlap]
        shares = {p: round(w / width, 4) for w, p in overlap}
        if not mine:  # rounding at the top end
            mine, shares = [pools[-1]], {pools[-1]: 1.0}
        if fallback_backlog is not None:
            mine += [p for p in pools if p not in mine and fallback_backlog.get(p, 1) > 0]
        out[g.instance] = Route(mine, shares)
        lo = hi
    return out


def assign_pools(
    generators: Sequence[GeneratorView], target_mix: Mapping[str, float], trained_by_pool: Mapping[str, int],
    backlog_by_pool: Mapping[str, int], **kw: Any,
) -> dict[str, list[str]]:
    """``assign_routes`` as pools in priority order only (a generator pulls from the first pool with work)."""
    plan = assign_routes(generators, target_mix, trained_by_pool, backlog_by_pool, **kw)
    return {i: r.pools for i, r in plan.routes.items()}


def plan_concurrency(latencies: Mapping[str, float], *, max_groups: int) -> dict[str, tuple[int, str]]:
    """Most groups each generator should sample at once, with the reason: ``max_groups``, scaled by
    typical latency / its latency (rounded up, at least 1) for a generator more than
    ``SLOW_FACTOR`` times slower than typical.  Unmeasured latency: ``max_groups``."""
    if max_groups < 1:
        raise ValueError(f"max_groups={max_groups} must be >= 1")
    measured = sorted(x for x in latencies.values() if math.isfinite(x) and x > 0)
    if not measured:
        return {i: (max_groups, "latency not measured yet") for i in latencies}
    # The lower median: with two generators, the healthy one is the reference, not the slowed one.
    typical = measured[(len(measured) - 1) // 2]
    out = {}
    for i, lat in latencies.items():
        if not (math.isfinite(lat) and lat > 0):
            out[i] = (max_groups, "latency not measured yet")
            continue
        # Within SLOW_FACTOR of typical: full batches (a latency measured under load is noisy).
        cap = max_groups if lat <= SLOW_FACTOR * typical else max(math.ceil(max_groups * typical / lat), 1)
        out[i] = (cap, f"latency {lat:.2f}s vs typical {typical:.2f}s: {cap} of {max_groups} groups at once")
    return out


def pause_decision(trainer: TrainerView, *, seen: bool) -> tuple[bool, str]:
    """Whether generators should take training work, and why (``seen``: a trainer heartbeat arrived)."""
    if seen and trainer.done:
        return True, f"trainer done at version {trainer.version}: new groups would never be trained"
    return False, "trainer running" if seen else "no trainer heard from yet"


def eval_due(version: int, last_evaluated: int, every: int) -> bool:
    """Evaluate at version 0, then whenever ``every`` versions have passed (a skipped multiple still counts)."""
    if every <= 0 or version < 0:
        return False
    return version >= (last_evaluated + every if last_evaluated >= 0 else 0)
