"""From what the controller knows to the decisions it publishes.  No I/O: ``step`` returns them.

Every period: admission (``law.plan_balanced``: the staleness window split by measured speed,
over-sampled by the measured usable fraction), a drain for each generator found silent (its unstarted
grant and unpublished groups are re-planned; its held tasks come back to the others after the task
ack wait) and a resume when it is heard from again, pause/resume by the trainer's state.  Every
``route_period``: pool routing (``law.assign_routes`` over the target mix, the mix trained since it
was set and the task backlog per pool) and per-generator concurrency (``law.plan_concurrency``).
A decision is re-sent only when it changes, or after ``refresh`` seconds when the generator's
heartbeat does not show it yet (a late joiner, a lost message).

What holds a generator is read back from CONTROL, not remembered by this process: the newest run
state addressed to it (``held_by``, from every decision ``observe`` sees).  A pause or drain that a
controller issued (this one, one that was killed before it lifted it, or the controller of an earlier
run under the same run name, whose last decisions a joining generator reads) is lifted once it no
longer applies: a drain when the generator is heard from, a pause while the trainer runs.  An
operator's pause or drain is left to the operator (the stall watch names it when it stops the run).

Each decision is a ``Control`` around one typed decision (``Admit``, ``RunState``, ``AssignPools``,
``Concurrency``, ``Evaluate``) with the inputs it was taken on and its reason, for
``rl.<run>.control.<service>.<instance>.<action>``.  Its ``seq`` comes from ``clock``, the run's one
``DecisionClock``: the service feeds it every seq seen on the run's CONTROL stream (``observe``), so
a decision taken here sorts after every decision any issuer (an operator, an earlier controller)
published before it, and a receiver that applies the latest of each kind applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlbus.schemas import Admit, AssignPools, Concurrency, Control, Decision, DecisionClock, Evaluate, RunState, SetMix
from rlbus.schemas.control import OPERATOR
from rlbus.services.controller.law import (
    AdmissionPlan,
    assign_routes,
    pause_decision,
    plan_balanced,
    plan_concurrency,
)
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.controller.state import DRAINING, ControllerState

SHARE_STEP = 0.1  # a generator's pool shares are re-sent when one moves by more (rates are noisy)
# The most metrics the controller's heartbeat carries: far under the schema's MAX_METRICS (a heartbeat
# over it cannot be built, and the heartbeat loop would end the service) and under a message's payload.
# Only per-generator entries can approach it (thousands of live instances); the last ones go first.
MAX_REPORTED_METRICS = 8192


class MixError(ValueError):
    """A requested target mix cannot be used; the message says why."""


def normalise_mix(mix: dict[str, Any], pools: list[str]) -> dict[str, float]:
    unknown = sorted(set(mix) - set(pools))
    if unknown:
        raise MixError(f"pool_mix names pools {unknown} that are not among the run's train pools {pools}")
    try:
        out = {str(p): float(x) for p, x in mix.items()}
    except (TypeError, ValueError):
        raise MixError(f"pool_mix {mix} must map pool names to numbers") from None
    if any(not math.isfinite(x) or x < 0 for x in out.values()) or sum(out.values()) <= 0:
        raise MixError(f"pool_mix {mix} needs finite, non-negative shares and at least one positive")
    total = sum(out.values())
    return {p: out.get(p, 0.0) / total for p in pools}


@dataclass
class _Sent:
    value: Any
    at: float


@dataclass
class Planner:
    cfg: ControllerSettings
    pools: list[str]  # the run's train pools
    batch_groups: int
    max_staleness: int
    state: ControllerState = field(init=False)
    clock: DecisionClock = field(default_factory=DecisionClock)

    def __post_init__(self) -> None:
        self.state = ControllerState(tau_s=self.cfg.tau, pools=self.pools)
        self.target_mix = normalise_mix(self.cfg.pool_mix or {p: 1.0 for p in self.pools}, self.pools)
        self.state.balance.set_target_mix(self.target_mix)
        self.mix_seq = -1
        self.last_plan: AdmissionPlan | None = None
        self.last_route_at = -math.inf
        self._admits: dict[tuple[str, str], _Sent] = {}
        self._routes: dict[str, _Sent] = {}
        self._concurrency: dict[str, _Sent] = {}
        self._paused_by_us: dict[str, _Sent] = {}
        self._evicted: dict[tuple[str, str], float] = {}
        # The newest RunState seen per (target instance or "all", boot or ""): what holds each generator,
        # whichever controller incarnation (or operator) issued it, read back from CONTROL.
        self.run_states: dict[tuple[str, str], Control] = {}
        self.signals = self.state.balance.signals([])

    # --- inputs ------------------------------------------------------------------------------
    def observe(self, ctl: Control) -> None:
        """A decision seen on the run's CONTROL stream (any issuer, this one included): the next
        decisions taken here must sort after it, and a run state is remembered as what holds its
        generator (``held_by``)."""
        self.clock.observe(ctl.seq)
        if isinstance(ctl.decision, RunState) and ctl.target_service == "generator":
            key = (ctl.target_instance, ctl.decision.boot)
            prev = self.run_states.get(key)
            if prev is None or ctl.seq > prev.seq:
                self.run_states[key] = ctl

    def held_by(self, instance: str, boot: str) -> Control | None:
        """The run state in force for this boot of ``instance``, as the generator orders them (the
        highest seq of those addressed to it, to its boot, or to all generators), or None."""
        found = [self.run_states.get(k) for k in ((instance, ""), (instance, boot), ("all", ""))]
        return max((c for c in found if c is not None), key=lambda c: c.seq, default=None)

    def _stale_hold(self, instance: str, boot: str, states: tuple[str, ...], now: float) -> Control | None:
        """The controller's pause or drain (or a resume of it that did not take) still holding a
        generator that reports one of ``states``, when this controller would not hold it now: whichever
        incarnation issued it (a restarted controller forgets what it decided, CONTROL does not).  An
        operator's decision is theirs to lift; a resume sent less than ``refresh`` ago may still arrive."""
        ctl = self.held_by(instance, boot)
        info = self.state.info.get(instance)
        if ctl is None or ctl.issuer == OPERATOR or info is None or info.state not in states or info.boot != boot:
            return None
        if ctl.action == "resume" and now - ctl.issued_at < self.cfg.refresh:
            return None
        return ctl

    def set_mix(self, ctl: Control) -> str | None:
        """Apply a ``SetMix`` request (the newest wins); returns a note, or raises ``MixError``."""
        if not isinstance(ctl.decision, SetMix):
            raise MixError(f"a {ctl.action!r} decision is not a mix request; the controller takes 'set_mix' only")
        if ctl.seq <= self.mix_seq:
            return None
        mix = normalise_mix(ctl.decision.mix, self.pools)
        self.mix_seq = ctl.seq
        if mix != self.target_mix:
            self.target_mix = mix
            self.state.balance.set_target_mix(mix)
            self.last_route_at = -math.inf  # re-route at the next step
            return f"target mix now {mix} ({ctl.reason or 'no reason given'})"
        return None

    # --- decisions -----------------------------------------------------------------------------
    def _control(self, instance: str, decision: Decision, reason: str, inputs: dict[str, Any], now: float) -> Control:
        ctl = Control(seq=self.clock.next(now), decision=decision, target_service="generator",
                      target_instance=instance, reason=reason, inputs=inputs, issued_at=now, issuer=self.cfg.instance)
        self.observe(ctl)  # what holds the generator now, before CONTROL echoes it back
        return ctl

    def routed_mix(self) -> dict[str, float]:
        """Expected share of starts per pool under the current routing (as the generators report it)."""
        rates = self.signals.effective_rates
        mix: dict[str, float] = {}
        for inst in self.state.live_instances():
            info = self.state.info.get(inst)
            if info is None or not info.pools:
                continue
            shares = info.shares or {info.pools[0]: 1.0}
            for p, w in shares.items():
                mix[p] = mix.get(p, 0.0) + w * rates.get(inst, 1.0)
        return mix

    def step(self, now: float) -> list[Control]:
        st = self.state
        out: list[Control] = []
        self.signals = st.balance.signals(st.live_instances())
        k = self.signals.usable_upper_for(self.routed_mix())
        plan = plan_balanced(st.views(), st.trainer, batch_groups=self.batch_groups, max_staleness=self.max_staleness,
                             now=now, silent_after=self.cfg.silent_after, max_outstanding=self.cfg.max_outstanding,
                             speeds=self.signals.generator_speeds, kept_fraction=k)
        self.last_plan = plan
        out += self._admissions(plan, k, now)
        out += self._silence(plan, now)
        self._forget(*st.retire())
        out += self._pausing(now)
        if now - self.last_route_at >= self.cfg.route_period:
            self.last_route_at = now
            out += self._routing(now)
            out += self._concurrencies(now)
        return out

    def _admissions(self, plan: AdmissionPlan, k: float, now: float) -> list[Control]:
        st = self.state
        out: list[Control] = []
        # Freshness floor: weights older than V - s could only yield samples beyond the bound.  Within
        # it, a generator on older weights w only gets the window as it stood at w (plan_balanced's
        # hold for weights), so it keeps sampling while the new version travels instead of stalling
        # every step for the weight hand-over (the simulator's model of the service).
        min_version = max(st.trainer.version - self.max_staleness, 0)
        for (instance, boot), grant in plan.grants.items():
            g = st.generators[(instance, boot)]
            prev = self._admits.get((instance, boot))
            if not g.alive or g.draining or not boot or (prev and prev.value == (grant, min_version)
                                                          and now - prev.at < self.cfg.refresh):
                continue  # not boot: a heartbeat that names no boot gives nothing to address a grant to
            out.append(self._control(
                instance, Admit(boot=boot, grant_total=grant, min_version=min_version), plan.reason,
                {"trainer_version": st.trainer.version, "allowed_total": plan.allowed_total,
                 "trained_bound": plan.trained_bound, "oversample": plan.oversample, "usable_upper": k,
                 "started_total": plan.started_total, "dropped": st.trainer.dropped_groups,
                 "pending": st.trainer.pending_groups}, now))
            self._admits[(instance, boot)] = _Sent((grant, min_version), now)
        return out

    def _forget(self, boots: list[tuple[str, str]], instances: list[str]) -> None:
        """What was sent to boots and instances the state no longer keeps (``ControllerState.retire``)."""
        for key in boots:
            self._admits.pop(key, None)
            self._evicted.pop(key, None)
        for instance in instances:
            for sent in (self._routes, self._concurrency, self._paused_by_us):
                sent.pop(instance, None)

    def _silence(self, plan: AdmissionPlan, now: float) -> list[Control]:
        st = self.state
        out: list[Control] = []
        for key in plan.lost:
            instance, _, boot = key.partition("/")
            g = st.generators.get((instance, boot))
            if g is None:
                continue
            self._evicted[(instance, boot)] = now
            q = st.queues
            info = st.info.get(instance)
            if info is not None and info.boot != boot:
                why = f"replaced by boot {info.boot}"
            elif info is not None and info.state == "stopped":
                why = "stopped"
            else:
                why = f"silent for more than {self.cfg.silent_after}s"
            out.append(self._control(
                instance, RunState(state="drain", boot=boot),
                f"{why}: its unstarted grant and unpublished groups are re-planned to the live generators; "
                f"the tasks it held come back to them after the task ack wait",
                {"last_seen_age_s": round(now - g.last_seen, 3) if g.last_seen else None, "published": g.published,
                 "live": st.live_instances(), "tasks_held": dict(q.held), "tasks_redelivered": dict(q.redelivered),
                 "admission": plan.reason}, now))
        for (instance, boot), at in list(self._evicted.items()):
            g = st.generators.get((instance, boot))
            if g is not None and g.alive:
                del self._evicted[(instance, boot)]
                out.append(self._control(instance, RunState(state="resume", boot=boot),
                                         f"heard from again {now - at:.1f}s after it was found silent",
                                         {"state": st.info.get(instance, None) and st.info[instance].state}, now))
        for (instance, boot), g in st.generators.items():
            held = self._stale_hold(instance, boot, DRAINING, now) if g.alive and g.draining else None
            if held is not None:
                out.append(self._control(
                    instance, RunState(state="resume", boot=boot),
                    f"heard from and {st.info[instance].state}, held by {held.issuer}'s {held.action} (seq {held.seq}: "
                    f"{held.reason[:80]}) that no live controller lifts: a drain is only for a silent generator",
                    {"held_by": held.msg_id, "state": st.info[instance].state}, now))
        return out

    def _pausing(self, now: float) -> list[Control]:
        st = self.state
        out: list[Control] = []
        paused, why = pause_decision(st.trainer, seen=st.trainer_seen)
        for instance in st.live_instances():
            info = st.info.get(instance)
            if info is None:
                continue
            prev = self._paused_by_us.get(instance)
            if paused and info.state == "running" and (prev is None or now - prev.at >= self.cfg.refresh):
                out.append(self._control(instance, RunState(state="pause"), why,
                                         {"trainer_version": st.trainer.version, "trainer_done": st.trainer.done}, now))
                self._paused_by_us[instance] = _Sent(True, now)
            elif not paused and prev is not None and info.state == "paused":
                out.append(self._control(instance, RunState(state="resume"), why,
                                         {"trainer_version": st.trainer.version, "trainer_done": st.trainer.done}, now))
                del self._paused_by_us[instance]
            elif not paused and (held := self._stale_hold(instance, info.boot, ("paused",), now)) is not None:
                # Paused by another controller incarnation (one that restarted, or an earlier run under
                # this run name: CONTROL keeps the last decision per subject and a new generator reads it).
                out.append(self._control(
                    instance, RunState(state="resume"),
                    f"{why}: held by {held.issuer}'s {held.action} (seq {held.seq}: {held.reason[:80]}), which no "
                    "longer applies", {"trainer_version": st.trainer.version, "held_by": held.msg_id}, now))
        return out

    def _routing(self, now: float) -> list[Control]:
        st, sig = self.state, self.signals
        out: list[Control] = []
        mix = {p: x for p, x in self.target_mix.items() if x > 0}
        live = [g for g in st.views() if g.alive and not g.draining]
        if not live or not mix:
            return out
        backlog = dict(st.queues.backlog) if st.queues.at > 0 else {}
        since = st.balance.trained_since_target()
        plan = assign_routes(
            live, mix, since, backlog, rates=sig.effective_rates or None,
            kept_by_pool={p: s.usable_fraction for p, s in sig.pools.items()
                          if math.isfinite(s.usable_fraction) and s.usable_fraction > 0},
            current={i: info.pools for i, info in st.info.items()})
        for instance, route in plan.routes.items():
            prev = self._routes.get(instance)
            info = st.info.get(instance)
            shares = {p: round(w, 3) for p, w in route.shares.items()}
            moved = prev is None or prev.value[0] != route.pools or any(
                abs(prev.value[1].get(p, 0.0) - shares.get(p, 0.0)) > SHARE_STEP for p in {*prev.value[1], *shares})
            unseen = info is not None and info.pools != route.pools and now - (prev.at if prev else 0.0) >= self.cfg.refresh
            if not (moved or unseen):
                continue
            rate = sig.effective_rates.get(instance, math.nan)
            out.append(self._control(
                instance, AssignPools(pools=route.pools, shares=shares),
                f"{plan.reason}; {instance} stacked at {rate:.2f} groups/s", {
                    "target_mix": mix, "trained_since_target": since, "mix_measured_on": st.balance.mix_source,
                    "backlog": backlog, "rates": dict(sig.effective_rates), "need": plan.need}, now))
            self._routes[instance] = _Sent((route.pools, shares), now)
        return out

    def _concurrencies(self, now: float) -> list[Control]:
        st = self.state
        out: list[Control] = []
        latency = {i: self.signals.generator_speeds[i].latency_s if i in self.signals.generator_speeds else math.nan
                   for i in st.live_instances()}
        for instance in latency:
            info = st.info.get(instance)
            if info is None or info.max_batch_groups < 1:
                continue
            cap, why = plan_concurrency(latency, max_groups=info.max_batch_groups)[instance]
            prev = self._concurrency.get(instance)
            unseen = info.concurrency != cap and (prev is None or now - prev.at >= self.cfg.refresh)
            if (prev is not None and prev.value == cap and not unseen) or (prev is None and cap == info.concurrency):
                continue
            out.append(self._control(instance, Concurrency(max_groups=cap), why,
                                     {"latency_s": {i: round(x, 4) for i, x in latency.items() if math.isfinite(x)},
                                      "max_batch_groups": info.max_batch_groups}, now))
            self._concurrency[instance] = _Sent(cap, now)
        return out

    def record(self, decision: Decision, reason: str, inputs: dict[str, Any], now: float) -> Control:
        """A record about this controller itself (a ``Stall``), on its own subject, in seq order."""
        return Control(seq=self.clock.next(now), decision=decision, target_service="controller",
                       target_instance=self.cfg.instance, reason=reason, inputs=inputs, issued_at=now,
                       issuer=self.cfg.instance)

    def evaluate(self, version: int, tasks: int, why: str, now: float) -> Control:
        return self._control("all", Evaluate(version=version, tasks=tasks), why,
                             {"trainer_version": self.state.trainer.version, "eval_every": self.cfg.eval_every}, now)

    # --- what the controller's heartbeat carries ------------------------------------------------
    def metrics(self) -> dict[str, float]:
        st = self.state
        m: dict[str, float] = {"controller/trainer_version": st.trainer.version,
                               "controller/live_generators": len(st.live_instances())}
        if self.last_plan is not None:
            p = self.last_plan
            m |= {"controller/allowed_total": p.allowed_total, "controller/oversample": p.oversample,
                  "controller/trained_bound": p.trained_bound, "controller/started_total": p.started_total}
        m |= {k: v for k, v in self.signals.as_metrics().items() if math.isfinite(v)}
        m |= {f"controller/target/{p}": x for p, x in self.target_mix.items()}
        m |= {f"controller/trained_since_target/{p}": n for p, n in st.balance.trained_since_target().items()}
        m["controller/mix_from_trainer"] = float(st.balance.mix_source == "trainer")
        m |= st.queues.metrics()
        over = len(m) - MAX_REPORTED_METRICS
        if over > 0:
            left_out = sorted(k for k in m if k.startswith("controller/generator/"))[-over:]
            for key in left_out:
                del m[key]
            m["controller/metrics_left_out"] = len(left_out)
        return m
