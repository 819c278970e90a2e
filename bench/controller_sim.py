"""Controller simulator: the real control law against synthetic generators and a trainer whose speeds change.

Drives ``services/controller/law.py`` and ``balance.py`` (the code the controller service runs) in a
discrete-event simulation and compares policies on the same scenario and seed:

- ``static``: tuned for the initial conditions: the cumulative admission budget split equally and
  for good between generators, no over-sampling, and a fixed pool per generator, the split between
  pools chosen by pilot runs of the initial conditions (``tuned_pools``);
- ``current``: the repo's law before this change (``plan_admission``: water-filling by unstarted
  grant), pools fixed and tuned the same way, no over-sampling;
- ``adaptive``: ``BalanceState`` -> ``plan_balanced`` (split by measured speed, window counted from
  each generator's weights, over-sampling by the measured usable fraction) and ``assign_pools``
  (routing by the trained mix's deficit), pools starting from an equal split (nothing measured yet);
- ``adaptive_no_oversample``: the same with over-sampling off, and so without holding budget for
  new weights either (``plan_balanced(hold_for_weights=...)``: in a window this tight, holding
  costs more trainer time than the stale drops it saves): what the split and routing alone give.

Model (seconds).  Trainer: FIFO of scored groups, judged like ``services/trainer/batch.py``
(filtered with probability ``1 - k_pool``; stale when ``V - start version > s``, on arrival and again
after every step); a step takes B kept groups and ``step_s`` seconds; its weights reach the
generators ``broadcast_s`` later.  Generator: ``slots`` groups at once (continuous batching); it
starts a group when a slot is free, its cumulative grant allows, its weights are at least
``V - s`` (the service's freshness floor) and, in priority order, one of its pools has tasks (the
backlogs never run dry here); a group lasts lognormal(median_pool x slowdown, sigma) drawn at its
start; the reward adds ``reward_s``.  Heartbeats and control messages arrive without delay.

Scenario (defaults): gen-0 slows 3x at ``t_slow``; the target mix moves from 70/30 to 40/60
math/code at ``t_mix`` (code groups are longer and filtered more); the trainer gets faster at
``t_trainer``; math's kept fraction drifts down all run (the policy solves more of it).

Per policy: trainer idle (overall, and per phase after ``settle_s``), utilisation from ``t_slow`` to
the end ("through the shift"), staleness of trained groups, groups dropped as stale (and how many
of them went stale while held for a batch), trained mix per phase and how long after ``t_mix`` it
follows the new target, and the share of the trainer's idle time during which the admission window
was full (high: the staleness bound limits, not the generators).  ``--sweep`` adds a sensitivity
table (staleness bound, tail weight, trainer batch order, freshness floor, other seeds).

``python -m bench.controller_sim [--seed N] [--duration S] [--sweep]`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rlbus.schemas.metric_keys import STALE_HELD
from rlbus.services.controller.balance import BalanceState
from rlbus.services.controller.law import (
    GeneratorView,
    TrainerView,
    allowed_started,
    assign_pools,
    plan_admission,
    plan_balanced,
)

POLICIES = ("static", "current", "adaptive", "adaptive_no_oversample")


@dataclass(frozen=True)
class Scenario:
    duration: float = 900.0
    batch_groups: int = 32
    max_staleness: int = 3
    generators: int = 8
    slots: int = 24
    median_s: dict[str, float] = field(default_factory=lambda: {"math": 2.0, "code": 3.5})
    sigma: float = 0.8  # lognormal: p99 ~ 6.4x the median
    kept_code: float = 0.5
    kept_math_start: float = 0.65
    kept_math_end: float = 0.45
    step_s: float = 3.0
    step_s_after: float = 2.5
    broadcast_s: float = 0.5
    reward_s: float = 0.3
    mix_before: dict[str, float] = field(default_factory=lambda: {"math": 0.7, "code": 0.3})
    mix_after: dict[str, float] = field(default_factory=lambda: {"math": 0.4, "code": 0.6})
    slow_instance: int = 0
    slowdown: float = 3.0
    t_slow: float = 225.0
    t_mix: float = 450.0
    t_trainer: float = 675.0
    settle_s: float = 60.0  # 'after adapting' = each phase minus its first settle_s seconds
    period_s: float = 0.5  # controller period
    route_s: float = 5.0
    tau_s: float = 20.0
    max_outstanding: int = 64
    mix_window_s: float = 60.0
    oldest_first: bool = False  # trainer batch order: False = arrival order, as services/trainer/batch.py
    weights_floor_lag: int | None = None  # generators start groups on weights >= V - lag; None = s (the service)

    def kept(self, pool: str, t: float) -> float:
        if pool != "math":
            return self.kept_code
        return self.kept_math_start + (self.kept_math_end - self.kept_math_start) * min(t / self.duration, 1.0)

    def step_time(self, t: float) -> float:
        return self.step_s if t < self.t_trainer else self.step_s_after

    def target(self, t: float) -> dict[str, float]:
        return self.mix_before if t < self.t_mix else self.mix_after

    def slow(self, gen: int, t: float) -> float:
        return self.slowdown if gen == self.slow_instance and t >= self.t_slow else 1.0

    def mean_s(self, pool: str) -> float:
        return self.median_s[pool] * math.exp(self.sigma ** 2 / 2)

    def phases(self) -> list[tuple[str, float, float]]:
        cuts = [min(c, self.duration) for c in (0.0, self.t_slow, self.t_mix, self.t_trainer, self.duration)]
        names = ["initial", "generator_slowed", "mix_changed", "trainer_faster"]
        return [(n, a, b) for n, a, b in zip(names, cuts, cuts[1:], strict=False) if b > a]

    def capacity_over_demand(self, t: float) -> float:
        """Generator slot-seconds available / needed to feed the trainer at the target mix (>1: enough)."""
        mix = self.target(t)
        per_kept = sum(w * self.mean_s(p) / self.kept(p, t) for p, w in mix.items())
        slots = sum(self.slots / self.slow(i, t) for i in range(self.generators))
        return slots / (self.batch_groups / self.step_time(t) * per_kept)


@dataclass
class Gen:
    index: int
    view: GeneratorView
    slots: int
    pools: list[str]
    version: int = 0
    running: int = 0


class Sim:
    def __init__(self, sc: Scenario, policy: str, seed: int, fixed_pools: list[list[str]] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: expected one of {POLICIES}")
        self.sc, self.policy = sc, policy
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.now = 0.0
        names = [f"gen-{i}" for i in range(sc.generators)]
        self.gens = [Gen(i, GeneratorView(n, "b0"), sc.slots, []) for i, n in enumerate(names)]
        # trainer
        self.version = 0
        self.held: list[tuple[int, str, str]] = []  # (start version, pool, generator)
        self.busy_until: float | None = None
        self.busy_start = 0.0
        self.busy: list[tuple[float, float]] = []
        self.trained_total = 0
        self.outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # pool -> reason -> n
        self.by_gen: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.staleness: dict[int, int] = defaultdict(int)
        self.trained_log: list[tuple[float, str]] = []
        self.min_version = 0
        # controller
        self.balance = BalanceState(tau_s=sc.tau_s)
        self.target = dict(sc.target(0.0))
        self.balance.set_target_mix(self.target)
        if fixed_pools is not None:
            for g, pools in zip(self.gens, fixed_pools, strict=True):
                g.pools = list(pools)
        else:  # no measurement yet: generators count as equal
            routes = assign_pools([g.view for g in self.gens], self.target, {}, {})
            for g in self.gens:
                g.pools = routes[g.view.instance]
        self.reroutes = 0
        self.last_reason = ""
        self.allowed = 0
        self.idle_samples: list[tuple[float, bool]] = []

    # -- events --------------------------------------------------------------------------------
    def at(self, t: float, kind: str, data: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def run(self) -> dict[str, Any]:
        sc = self.sc
        self.at(0.0, "control")
        self.at(sc.route_s, "route")
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            if t > sc.duration:
                break
            self.now = t
            getattr(self, f"on_{kind}")(data)
        if self.busy_until is not None:
            self.busy.append((self.busy_start, min(self.busy_until, sc.duration)))
        return self.report()

    def on_control(self, _: Any) -> None:
        if self.busy_until is None:  # why is the trainer waiting: is the admission window full?
            started = sum(g.view.started for g in self.gens)
            self.idle_samples.append((self.now, started >= self.allowed - self.sc.generators))
        self.control()
        lag = self.sc.max_staleness if self.sc.weights_floor_lag is None else self.sc.weights_floor_lag
        self.min_version = max(self.version - lag, 0)
        for g in self.gens:
            self.try_start(g)
        self.at(self.now + self.sc.period_s, "control")

    def on_route(self, _: Any) -> None:
        if self.policy.startswith("adaptive"):
            self.route()
        self.at(self.now + self.sc.route_s, "route")

    def on_finish(self, data: tuple[Gen, int, str, bool]) -> None:
        g, v0, pool, kept = data
        g.running -= 1
        g.view.published += 1
        self.at(self.now + self.sc.reward_s, "scored", (g.view.instance, v0, pool, kept))
        self.try_start(g)

    def on_scored(self, data: tuple[str, int, str, bool]) -> None:
        inst, v0, pool, kept = data
        if not kept:
            self.drop(pool, inst, "filtered")
        elif self.version - v0 > self.sc.max_staleness:
            self.drop(pool, inst, "stale")
        else:
            self.held.append((v0, pool, inst))
            self.outcomes[pool]["train"] += 1
            self.by_gen[inst]["train"] += 1
        self.try_train()

    def on_step_done(self, batch: list[tuple[int, str, str]]) -> None:
        self.busy.append((self.busy_start, self.now))
        self.busy_until = None
        self.version += 1
        self.trained_total += len(batch)
        for _, pool, _ in batch:
            self.trained_log.append((self.now, pool))
        still = []
        for item in self.held:  # batch.py's requeue_stale
            if self.version - item[0] > self.sc.max_staleness:
                self.outcomes[item[1]]["train"] -= 1
                self.by_gen[item[2]]["train"] -= 1
                self.drop(item[1], item[2], "stale")
                self.outcomes[item[1]][STALE_HELD] += 1
                self.by_gen[item[2]][STALE_HELD] += 1
            else:
                still.append(item)
        self.held = still
        self.at(self.now + self.sc.broadcast_s, "weights", self.version)
        self.try_train()

    def on_weights(self, version: int) -> None:
        for g in self.gens:
            g.version = max(g.version, version)
            self.try_start(g)

    # -- the trainer and the generators ---------------------------------------------------------
    def drop(self, pool: str, inst: str, reason: str) -> None:
        self.outcomes[pool][reason] += 1
        self.by_gen[inst][reason] += 1

    @property
    def dropped_total(self) -> int:
        return sum(n for c in self.outcomes.values() for r, n in c.items() if r not in ("train", STALE_HELD))

    def try_train(self) -> None:
        if self.busy_until is not None or len(self.held) < self.sc.batch_groups:
            return
        if self.sc.oldest_first:
            self.held.sort(key=lambda item: item[0])  # stable: FIFO within a version
        batch, self.held = self.held[: self.sc.batch_groups], self.held[self.sc.batch_groups:]
        for v0, _, _ in batch:
            self.staleness[self.version - v0] += 1
        self.busy_start = self.now
        self.busy_until = self.now + self.sc.step_time(self.now)
        self.at(self.busy_until, "step_done", batch)

    def try_start(self, g: Gen) -> None:
        sc = self.sc
        while g.running < g.slots and g.view.started < g.view.granted and g.version >= self.min_version:
            pool = g.pools[0]
            dur = self.rng.lognormvariate(math.log(sc.median_s[pool] * sc.slow(g.index, self.now)), sc.sigma)
            kept = self.rng.random() < sc.kept(pool, self.now)
            g.view.started += 1
            g.running += 1
            self.at(self.now + dur, "finish", (g, g.version, pool, kept))

    # -- the controller ------------------------------------------------------------------------
    def trainer_view(self) -> TrainerView:
        training = self.sc.batch_groups if self.busy_until is not None else 0
        return TrainerView(version=self.version, dropped_groups=self.dropped_total, trained_groups=self.trained_total,
                           pending_groups=len(self.held) + training)

    def control(self) -> None:
        sc, views = self.sc, [g.view for g in self.gens]
        for g in self.gens:
            g.view.last_seen = self.now
            g.view.weights_version = g.version
        kw: dict[str, Any] = dict(batch_groups=sc.batch_groups, max_staleness=sc.max_staleness, now=self.now,
                                  silent_after=5.0, max_outstanding=sc.max_outstanding)
        trainer = self.trainer_view()
        if self.policy == "static":
            self.allowed = allowed = allowed_started(trainer, batch_groups=sc.batch_groups,
                                                     max_staleness=sc.max_staleness)
            n = len(views)
            for i, v in enumerate(views):
                share = allowed // n + (1 if i < allowed % n else 0)
                v.granted = max(v.granted, min(share, v.started + sc.max_outstanding))
            return
        if self.policy == "current":
            plan = plan_admission(views, trainer, **kw)
            self.last_reason, self.allowed = plan.reason, plan.allowed_total
            return
        self.observe()
        sig = self.balance.signals()
        k = sig.usable_upper_for(self.routed_mix()) if self.policy == "adaptive" else 1.0
        plan = plan_balanced(views, trainer, speeds=sig.generator_speeds, kept_fraction=k,
                             hold_for_weights=self.policy == "adaptive", **kw)
        self.last_reason, self.allowed = plan.reason, plan.allowed_total

    def observe(self) -> None:
        for g in self.gens:
            self.balance.observe_generator(g.view.instance, self.now, started=g.view.started,
                                           published=g.view.published, boot=g.view.boot, slots=g.slots,
                                           pool=g.pools[0])
        idle = self.now - sum(b - a for a, b in self.busy) - (self.now - self.busy_start if self.busy_until else 0.0)
        self.balance.observe_trainer(self.now, trained_total=self.trained_total,
                                     by_pool={p: dict(c) for p, c in self.outcomes.items()},
                                     by_generator={i: dict(c) for i, c in self.by_gen.items()}, idle_s=idle)

    def routed_mix(self) -> dict[str, float]:
        """Share of starts per pool under the current routing (each generator on its first pool)."""
        rates = self.balance.signals().effective_rates
        mix: dict[str, float] = defaultdict(float)
        for g in self.gens:
            mix[g.pools[0]] += rates.get(g.view.instance, 1.0)
        return dict(mix)

    def route(self) -> None:
        target = self.sc.target(self.now)
        if target != self.target:
            self.target = dict(target)
            self.balance.set_target_mix(target)
        sig = self.balance.signals()
        routes = assign_pools([g.view for g in self.gens], self.target, self.balance.trained_since_target(),
                              {p: 10**9 for p in self.target}, rates=sig.effective_rates,
                              kept_by_pool={p: s.usable_fraction for p, s in sig.pools.items()
                                            if math.isfinite(s.usable_fraction)},
                              current={g.view.instance: g.pools for g in self.gens})
        for g in self.gens:
            new = routes.get(g.view.instance, g.pools)
            self.reroutes += new[0] != g.pools[0]
            g.pools = new

    # -- metrics -------------------------------------------------------------------------------
    def busy_in(self, a: float, b: float) -> float:
        return sum(max(min(e, b) - max(s, a), 0.0) for s, e in self.busy)

    def window_full_share(self, a: float, b: float) -> float | None:
        """Share of the trainer's idle time (sampled each control period) with the admission window full."""
        xs = [full for t, full in self.idle_samples if a <= t < b]
        return round(sum(xs) / len(xs), 3) if xs else None

    def trained_mix(self, a: float, b: float) -> dict[str, float]:
        counts: dict[str, int] = defaultdict(int)
        for t, p in self.trained_log:
            if a <= t < b:
                counts[p] += 1
        n = sum(counts.values())
        return {p: round(c / n, 3) for p, c in sorted(counts.items())} if n else {}

    def mix_follow_s(self) -> float | None:
        """Seconds after the mix change until every later window's trained mix is within 0.05 of target."""
        sc, w = self.sc, self.sc.mix_window_s
        ok_since = None
        t = sc.t_mix
        while t + w <= sc.duration:
            mix = self.trained_mix(t, t + w)
            good = bool(mix) and all(abs(mix.get(p, 0.0) - x) <= 0.05 for p, x in sc.mix_after.items())
            ok_since = (ok_since if ok_since is not None else t) if good else None
            t += w / 3
        return None if ok_since is None else round(ok_since + w - sc.t_mix, 1)

    def report(self) -> dict[str, Any]:
        sc = self.sc
        phases = []
        settled_busy = settled_len = 0.0
        for name, a, b in sc.phases():
            a2 = min(a + sc.settle_s, b)
            settled_busy += self.busy_in(a2, b)
            settled_len += b - a2
            phases.append({"phase": name, "start": a, "idle": round(1 - self.busy_in(a, b) / (b - a), 4),
                           "idle_while_window_full": self.window_full_share(a2, b),
                           "idle_after_adapting": round(1 - self.busy_in(a2, b) / (b - a2), 4) if b > a2 else None,
                           "trained_mix": self.trained_mix(a2, b), "target_mix": sc.target(a),
                           "capacity_over_demand": round(sc.capacity_over_demand(a), 3)})
        n_trained = sum(self.staleness.values())
        stale = sum(c.get("stale", 0) for c in self.outcomes.values())
        return {
            "trainer_idle": round(1 - self.busy_in(0, sc.duration) / sc.duration, 4),
            "trainer_idle_after_adapting": round(1 - settled_busy / settled_len, 4),
            "utilisation_through_shift": round(self.busy_in(sc.t_slow, sc.duration) / (sc.duration - sc.t_slow), 4),
            "versions": self.version,
            "groups_trained": n_trained,
            "staleness_mean": round(sum(k * n for k, n in self.staleness.items()) / n_trained, 3) if n_trained else None,
            "staleness_max": max(self.staleness) if self.staleness else None,
            "trained_beyond_bound": sum(n for k, n in self.staleness.items() if k > sc.max_staleness),
            "dropped_stale": stale,
            "stale_share_of_started": round(stale / max(sum(g.view.started for g in self.gens), 1), 4),
            "dropped_filtered": sum(c.get("filtered", 0) for c in self.outcomes.values()),
            "groups_started": sum(g.view.started for g in self.gens),
            "stale_by_generator": {i: c.get("stale", 0) for i, c in sorted(self.by_gen.items())},
            "stale_while_held": sum(c.get(STALE_HELD, 0) for c in self.outcomes.values()),
            "idle_while_window_full": self.window_full_share(0.0, sc.duration),
            "mix_follow_s": self.mix_follow_s(),
            "reroutes": self.reroutes,
            "phases": phases,
        }


def tuned_pools(sc: Scenario, policy: str, seed: int, pilot_s: float = 150.0) -> list[list[str]]:
    """The fixed assignment a careful operator would pick for the initial conditions: how many
    generators on each pool, chosen by pilot runs (no events) as the one whose trained mix is
    closest to the initial target, ties to lower trainer idle."""
    first, second = sorted(sc.mix_before, key=lambda p: -sc.mix_before[p])[:2]
    pilot = replace(sc, duration=pilot_s, t_slow=math.inf, t_mix=math.inf, t_trainer=math.inf,
                    kept_math_end=sc.kept_math_start)
    best: tuple[float, float, list[list[str]]] | None = None
    for n_first in range(1, sc.generators):
        pools = [[first] if i < n_first else [second] for i in range(sc.generators)]
        r = Sim(pilot, policy, seed, fixed_pools=pools).run()
        settled = [ph for ph in r["phases"] if ph["phase"] == "initial"][0]
        err = abs(settled["trained_mix"].get(first, 0.0) - sc.mix_before[first])
        cand = (round(err, 2), r["trainer_idle_after_adapting"], pools)
        if best is None or cand[:2] < best[:2]:
            best = cand
    assert best is not None
    return best[2]


def simulate(sc: Scenario, policy: str, seed: int) -> dict[str, Any]:
    fixed = tuned_pools(sc, policy, seed) if policy in ("static", "current") else None
    out = Sim(sc, policy, seed, fixed_pools=fixed).run()
    if fixed is not None:
        out["fixed_pools"] = {f"gen-{i}": p[0] for i, p in enumerate(fixed)}
    return out


def compare(sc: Scenario, seed: int, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    arms = {p: simulate(sc, p, seed) for p in policies}
    out: dict[str, Any] = {"seed": seed, "scenario": asdict(sc), "policies": arms}
    if "adaptive" in arms and "static" in arms:
        ad, st = arms["adaptive"], arms["static"]
        ratio = ad["utilisation_through_shift"] / max(st["utilisation_through_shift"], 1e-9)
        out["utilisation_ratio_adaptive_over_static"] = round(ratio, 3)
        if "current" in arms:
            out["utilisation_ratio_adaptive_over_current"] = round(
                ad["utilisation_through_shift"] / max(arms["current"]["utilisation_through_shift"], 1e-9), 3)
        over = [ph for ph in ad["phases"] if (ph["idle_after_adapting"] or 0.0) > 0.05]
        idle = {"value": ad["trainer_idle_after_adapting"], "met": ad["trainer_idle_after_adapting"] <= 0.05,
                "worst_phase": max(ad["phases"], key=lambda ph: ph["idle_after_adapting"] or 0.0)["phase"],
                "met_in_every_phase": not over}
        if over:
            idle["why_not_every_phase"] = "; ".join(
                f"{ph['phase']}: idle {ph['idle_after_adapting']:.3f} with capacity/demand "
                f"{ph['capacity_over_demand']}, admission window full during {100 * (ph['idle_while_window_full'] or 0):.0f}% "
                f"of that idle time: the staleness window (s+1)*B (and what the filter and the long tail waste in it) "
                f"limits there, not generator capacity" for ph in over)
        out["targets"] = {
            "trainer_idle_after_adapting<=0.05": idle,
            "trained_beyond_bound==0": {"value": sum(a["trained_beyond_bound"] for a in arms.values()),
                                        "met": all(a["trained_beyond_bound"] == 0 for a in arms.values())},
            "utilisation_ratio>=1.25": {"value": round(ratio, 3), "met": ratio >= 1.25},
        }
    return out


SWEEP: dict[str, dict[str, Any]] = {
    "s=2": {"max_staleness": 2},
    "s=4": {"max_staleness": 4},
    "sigma=0.5": {"sigma": 0.5},
    "trainer_oldest_first": {"oldest_first": True},
    "weights_floor_lag=0": {"weights_floor_lag": 0},
}


def sweep(sc: Scenario, seed: int) -> dict[str, Any]:
    """Headline numbers (adaptive vs static) when one knob of the scenario moves, and other seeds."""
    rows: dict[str, Any] = {}
    variants = [(name, replace(sc, **kw), seed) for name, kw in SWEEP.items()]
    variants += [(f"seed={seed + k}", sc, seed + k) for k in (1, 2)]
    for name, v, sd in variants:
        r = compare(v, sd, ("static", "adaptive"))
        ad, st = r["policies"]["adaptive"], r["policies"]["static"]
        rows[name] = {"ratio": r["utilisation_ratio_adaptive_over_static"],
                      "adaptive_idle_after_adapting": ad["trainer_idle_after_adapting"],
                      "adaptive_worst_phase_idle": max(ph["idle_after_adapting"] or 0.0 for ph in ad["phases"]),
                      "static_idle_after_adapting": st["trainer_idle_after_adapting"],
                      "adaptive_stale_share": ad["stale_share_of_started"], "static_stale_share": st["stale_share_of_started"],
                      "trained_beyond_bound": ad["trained_beyond_bound"] + st["trained_beyond_bound"]}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=None, help="simulated seconds (events scale with it)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sweep", action="store_true", help="add a sensitivity table (~25 s more)")
    args = ap.parse_args(argv)
    sc = Scenario()
    if args.duration:
        f = args.duration / sc.duration
        sc = replace(sc, duration=args.duration, t_slow=sc.t_slow * f, t_mix=sc.t_mix * f, t_trainer=sc.t_trainer * f)
    out = compare(sc, args.seed, tuple(args.policies.split(",")))
    if args.sweep:
        out["sweep"] = sweep(sc, args.seed)
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
