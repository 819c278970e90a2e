"""Effective-throughput accounting for the controller.  Pure, no I/O.

Fed with the cumulative counters that heartbeats carry (sampled at any cadence), ``BalanceState``
keeps exponentially decayed sums of their increments and of the elapsed time (time constant
``tau_s``) and derives, overall and per pool:

- **C**, trainer consumption: groups trained per second;
- **P**, production: groups the generators published per second (per pool: split by the mix of
  arrivals at the trainer);
- **k**, kept fraction: what passes the filter (zero-variance, invalid), ``kept / (kept + filtered
  + invalid)`` with ``kept = train + stale_held``;
- **u**, usable fraction: what passes the filter *and arrives in time*, ``kept / arrived``.  Late
  arrivals (the long tail of completion times) count against it, groups that went stale while held
  for a batch do not: that is the admission law's own surplus, and counting it would make
  over-sampling feed on itself.  ``plan_balanced`` over-samples by ``1/u`` (its upper bound);
- **E**, effective production: P x the share of arrivals actually trained (every loss counted).
  With admission working, E and C track each other; the trainer's recent idle fraction says when
  the generators are the short side.

Per generator (``Speed``, what ``law.plan_balanced`` splits by): the published rate over intervals in
which it had work (an idle generator is not a slow one), its latency by Little's law (time-averaged
running groups / publish rate: load-independent, unlike the rate, so a generator given little work
does not look slow for it), its slots as it reports them, and its fresh fraction (share of its
groups that arrived in time).

Outcomes come per pool and per generator, as the trainer reports them (``schemas/metric_keys.py``);
until the trainer reports per-pool counts, the trained mix is judged on what the generators
published per pool (``observe_published_by_pool``, ``mix_source``).

A restarted trainer (its trained total went down) or a new generator boot counts again from zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rlbus.schemas.metric_keys import OUTCOMES, STALE_HELD
from rlbus.services.controller.law import Speed

# ``STALE_HELD``: the part of ``stale`` that had passed the filter and went stale while held for a
# batch (the trainer's requeue_stale moves it from ``train``): still kept, as far as the filter goes.


@dataclass
class Decayed:
    """Exponentially decayed sums of counter increments and of elapsed time."""

    tau_s: float
    time: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, dt: float, deltas: Mapping[str, float]) -> None:
        f = math.exp(-dt / self.tau_s)
        self.time = self.time * f + dt
        for k in self.sums:
            self.sums[k] *= f
        for k, v in deltas.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def get(self, key: str) -> float:
        return self.sums.get(key, 0.0)

    def rate(self, key: str) -> float:
        return self.get(key) / self.time if self.time > 0 else 0.0


@dataclass
class _Counters:
    """The last values of some cumulative counters; ``step`` yields the increments since then.

    Some counters legitimately go down (the trainer moves a held group from ``train`` to ``stale``;
    a generator gives back a slot it could not start), so a restart is recognised on one counter that
    only ever grows, ``monotone``: when it goes down, every counter counts again from zero.
    """

    monotone: str
    t: float | None = None
    last: dict[str, float] = field(default_factory=dict)

    def step(self, t: float, values: Mapping[str, float]) -> tuple[float, dict[str, float]] | None:
        if self.t is None:
            self.t, self.last = t, dict(values)
            return None
        dt = t - self.t
        if dt <= 0:
            return None
        restarted = values.get(self.monotone, 0.0) < self.last.get(self.monotone, 0.0)
        deltas = {k: v if restarted else v - self.last.get(k, 0.0) for k, v in values.items()}
        self.t = t
        self.last = dict(values) if restarted else {**self.last, **values}
        return dt, deltas


def wilson_upper(p: float, n: float, z: float = 2.0) -> float:
    """Upper confidence bound of a proportion ``p`` seen over ``n`` (decayed) trials."""
    if n <= 0 or not math.isfinite(p):
        return 1.0
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(max(p * (1 - p), 0.0) / n + z2 / (4 * n * n))
    return min((centre + spread) / (1 + z2 / n), 1.0)


@dataclass(frozen=True)
class PoolSignals:
    consumption: float  # C_p: groups accepted for training per second
    production: float  # P_p: groups published per second
    kept_fraction: float  # k_p: passes the filter (nan before anything was judged)
    usable_fraction: float  # u_p: passes the filter and arrives fresh
    usable_fraction_upper: float
    stale_fraction: float  # of arrivals, late or gone stale while held
    effective: float  # E_p: P_p x share of arrivals actually trained
    trained_total: int


@dataclass(frozen=True)
class Signals:
    consumption: float  # C
    production: float  # P
    kept_fraction: float  # k (nan before anything was judged)
    usable_fraction: float  # u = k x share arriving in time
    usable_fraction_upper: float  # what over-sampling uses (``plan_balanced(kept_fraction=...)``)
    effective: float  # E
    stale_fraction: float
    trainer_idle: float  # recent idle fraction (nan if the trainer does not report idle time)
    pools: dict[str, PoolSignals]
    generator_speeds: dict[str, Speed]  # ``plan_balanced(speeds=...)``
    effective_rates: dict[str, float]  # published/s x fresh: ``assign_pools(rates=...)``

    @property
    def balance(self) -> float:
        """E / C: below 1 the generators are short, above 1 work piles up for the trainer."""
        return self.effective / self.consumption if self.consumption > 0 else math.nan

    def usable_upper_for(self, mix: Mapping[str, float]) -> float:
        """Conservative usable fraction of work started in ``mix`` (e.g. the routed shares): after a
        mix change, what arrives lags what is running."""
        w = {p: x for p, x in mix.items() if p in self.pools and x > 0}
        if not w:
            return self.usable_fraction_upper
        return sum(self.pools[p].usable_fraction_upper * x for p, x in w.items()) / sum(w.values())

    def as_metrics(self) -> dict[str, float]:
        m = {"controller/balance/consumption": self.consumption, "controller/balance/production": self.production,
             "controller/balance/kept_fraction": self.kept_fraction,
             "controller/balance/usable_fraction": self.usable_fraction, "controller/balance/effective": self.effective,
             "controller/balance/stale_fraction": self.stale_fraction, "controller/balance/trainer_idle": self.trainer_idle}
        for p, s in self.pools.items():
            m |= {f"controller/pool/{p}/consumption": s.consumption, f"controller/pool/{p}/production": s.production,
                  f"controller/pool/{p}/kept_fraction": s.kept_fraction, f"controller/pool/{p}/effective": s.effective}
        for g, r in self.effective_rates.items():
            m[f"controller/generator/{g}/effective_rate"] = r
            m[f"controller/generator/{g}/latency_s"] = self.generator_speeds[g].latency_s
        return m


class BalanceState:
    """Observations in, ``Signals`` out.  Feed it every heartbeat (or every control period)."""

    def __init__(self, *, tau_s: float = 30.0) -> None:
        if tau_s <= 0:
            raise ValueError(f"tau_s={tau_s} must be > 0 (seconds over which rates are smoothed)")
        self.tau_s = tau_s
        self._trainer = _Counters("trained")
        self._trainer_sums = Decayed(tau_s)
        self._idle_seen = False
        self._gen: dict[str, tuple[str, _Counters, Decayed]] = {}
        self._gen_running: dict[str, float] = {}
        self._slots: dict[str, tuple[int, str]] = {}
        self.trained_by_pool: dict[str, int] = {}  # cumulative, as last reported
        self._pool_proxy = False  # trained_by_pool holds what generators published (no per-pool trainer counts)
        self.target_mix: dict[str, float] = {}
        self._mix_base: dict[str, int] = {}

    def observe_generator(self, instance: str, t: float, *, started: int, published: int, boot: str = "",
                          slots: int = 0, pool: str = "") -> None:
        """Cumulative ``started``/``published`` of this boot; ``slots``: groups it runs at once (0 = unknown);
        ``pool``: the pool it samples first (its routing)."""
        self._slots[instance] = (slots, pool)
        prev = self._gen.get(instance)
        if prev is None or prev[0] != boot:
            # A new boot starts a new baseline; the rate measured so far carries over.
            sums = prev[2] if prev is not None else Decayed(self.tau_s)
            self._gen[instance] = prev = (boot, _Counters("published"), sums)
            self._gen_running[instance] = 0.0
        _, counters, sums = prev
        values = {"started": float(started), "published": float(published)}
        step = counters.step(t, values)
        running_before = self._gen_running.get(instance, 0.0)
        self._gen_running[instance] = max(started - published, 0)
        if step is None:
            return
        dt, d = step
        if running_before > 0 or d["published"] > 0 or d["started"] > 0:
            sums.add(dt, {"published": d["published"], "running_s": running_before * dt})

    def forget_generator(self, instance: str) -> None:
        """A generator gone for good: its rates, and the trainer's outcomes counted under its name."""
        self._gen.pop(instance, None)
        self._gen_running.pop(instance, None)
        self._slots.pop(instance, None)
        prefix = f"gen:{instance}/"
        for counts in (self._trainer_sums.sums, self._trainer.last):
            for key in [k for k in counts if k.startswith(prefix)]:
                del counts[key]

    def observe_trainer(self, t: float, *, trained_total: int, by_pool: Mapping[str, Mapping[str, int]],
                        by_generator: Mapping[str, Mapping[str, int]] | None = None,
                        idle_s: float | None = None) -> None:
        """``by_pool[pool][reason]`` and ``by_generator[instance][reason]``: cumulative group outcomes
        (``OUTCOMES``, plus ``STALE_HELD`` when the trainer reports it);
        ``idle_s``: cumulative seconds spent waiting for a batch."""
        values: dict[str, float] = {"trained": float(trained_total)}
        if self._pool_proxy and by_pool:
            # Per-pool trainer counts from now on: the stand-in and the mix judged on it go.
            self.trained_by_pool, self._mix_base, self._pool_proxy = {}, {}, False
        for pool, counts in by_pool.items():
            for r in (*OUTCOMES, STALE_HELD):
                values[f"pool:{pool}/{r}"] = float(counts.get(r, 0))
            self.trained_by_pool[pool] = int(counts.get("train", 0))
        for inst, counts in (by_generator or {}).items():
            for r in (*OUTCOMES, STALE_HELD):
                values[f"gen:{inst}/{r}"] = float(counts.get(r, 0))
        if idle_s is not None:
            values["idle_s"] = float(idle_s)
            self._idle_seen = True
        step = self._trainer.step(t, values)
        if step is not None:
            self._trainer_sums.add(*step)

    def observe_published_by_pool(self, totals: Mapping[str, int]) -> None:
        """Stand-in for the trained mix while the trainer reports no per-pool counts: cumulative groups
        the generators published per pool (every boot summed).  Ignored once the trainer reports them."""
        if self._pool_proxy or not self.trained_by_pool:
            self._pool_proxy = True
            self.trained_by_pool = {p: int(n) for p, n in totals.items()}

    @property
    def mix_source(self) -> str:
        """What ``trained_since_target`` counts: "trainer" (trained groups) or "generators" (published)."""
        return "generators" if self._pool_proxy else "trainer"

    def restart_trainer(self) -> None:
        """A new trainer process whose per-process counters start from zero (``trained`` may not go down
        when it resumes from a checkpoint): take its next report as the new baseline."""
        self._trainer = _Counters("trained")

    def set_target_mix(self, mix: Mapping[str, float]) -> None:
        """A new target mix: the trained mix is judged from here on (``trained_since_target``)."""
        self.target_mix = dict(mix)
        self._mix_base = dict(self.trained_by_pool)

    def trained_since_target(self) -> dict[str, int]:
        return {p: max(self.trained_by_pool.get(p, 0) - self._mix_base.get(p, 0), 0) for p in self.trained_by_pool}

    def signals(self, live: Iterable[str] | None = None) -> Signals:
        s = self._trainer_sums
        live_set = set(live) if live is not None else set(self._gen)
        rates = {g: sums.rate("published") for g, (_, _, sums) in self._gen.items() if g in live_set and sums.time > 0}
        production = sum(rates.values())
        pools = sorted({k.split("/", 1)[0][5:] for k in s.sums if k.startswith("pool:")})

        def tally(keys: list[str]) -> dict[str, float]:
            t = {r: sum(s.get(f"{k}/{r}") for k in keys) for r in (*OUTCOMES, STALE_HELD)}
            t["kept"] = t["train"] + t[STALE_HELD]  # passed the filter
            t["judged"] = t["kept"] + t["filtered"] + t["invalid"]  # the filter's verdicts (late arrivals have none)
            t["arrived"] = t["judged"] + t["stale"] - t[STALE_HELD]
            return t

        def ratio(a: float, b: float) -> float:
            return a / b if b > 0 else math.nan

        every = tally([f"pool:{p}" for p in pools])
        pool_signals = {}
        for p in pools:
            t = tally([f"pool:{p}"])
            prod = production * ratio(t["arrived"], every["arrived"]) if every["arrived"] > 0 else 0.0
            usable = ratio(t["kept"], t["arrived"])
            pool_signals[p] = PoolSignals(
                consumption=s.rate(f"pool:{p}/train"), production=prod, kept_fraction=ratio(t["kept"], t["judged"]),
                usable_fraction=usable, usable_fraction_upper=wilson_upper(usable, t["arrived"]),
                stale_fraction=ratio(t["stale"], t["arrived"]) if t["arrived"] > 0 else 0.0,
                effective=prod * (ratio(t["train"], t["arrived"]) if t["arrived"] > 0 else 1.0),
                trained_total=self.trained_by_pool.get(p, 0))
        speeds = {}
        for g in rates:
            t = tally([f"gen:{g}"])
            sums = self._gen[g][2]
            running_s = sums.get("running_s")
            # A generator that has published (almost) nothing lately: at least this slow.
            latency = running_s / max(sums.get("published"), 0.25) if running_s > 0 else math.nan
            slots, pool = self._slots.get(g, (0, ""))
            speeds[g] = Speed(rate=rates[g], latency_s=latency, slots=slots, pool=pool,
                              fresh=1.0 - (t["stale"] - t[STALE_HELD]) / t["arrived"] if t["arrived"] > 0 else 1.0)
        usable = ratio(every["kept"], every["arrived"])
        return Signals(
            consumption=s.rate("trained"), production=production, kept_fraction=ratio(every["kept"], every["judged"]),
            usable_fraction=usable, usable_fraction_upper=wilson_upper(usable, every["arrived"]),
            effective=(sum(x.effective for x in pool_signals.values()) if pools else
                       production * (ratio(every["train"], every["arrived"]) if every["arrived"] > 0 else 1.0)),
            stale_fraction=ratio(every["stale"], every["arrived"]) if every["arrived"] > 0 else 0.0,
            trainer_idle=s.rate("idle_s") if self._idle_seen else math.nan, pools=pool_signals,
            generator_speeds=speeds, effective_rates={g: sp.rate * sp.fresh for g, sp in speeds.items()})
