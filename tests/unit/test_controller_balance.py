"""The balancing controller: rate-aware admission, over-sampling, pool routing, measurements, and the simulator.

The admission properties are checked on a small tick simulation where groups finish in start
order after a fixed latency, the filter keeps exactly a share ``k`` of them, and generators sample
with the trainer's current weights: there the law's promise is exact (no kept group is ever beyond
the staleness bound), so a violation is a bug in the law, not noise.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.controller_sim import Scenario, compare
from rlbus.schemas.metric_keys import STALE_HELD
from rlbus.services.controller.balance import BalanceState, wilson_upper
from rlbus.services.controller.law import (
    GeneratorView,
    Speed,
    TrainerView,
    allowed_started,
    assign_pools,
    oversample_extra,
    plan_admission,
    plan_balanced,
)

KW: dict[str, Any] = dict(silent_after=5.0)


def fifo_run(*, batch_groups: int, max_staleness: int, kept: float, kept_hat: float, latency: int, speeds: list[int],
             ticks: int, max_outstanding: int = 10_000, rates: list[float] | None = None) -> dict:
    """Tick simulation with in-order completion and an exact filter (group i kept iff floor((i+1)k) > floor(ik))."""
    gens = [GeneratorView(f"g{i}", "b") for i in range(len(speeds))]
    speed_map = {g.instance: Speed(rate=r) for g, r in zip(gens, rates or [1.0] * len(gens), strict=True)}
    trainer = TrainerView()
    running: list[tuple[int, int, int, GeneratorView]] = []  # (done tick, start index, version, generator)
    held: list[int] = []  # start versions
    index = 0
    staleness: list[int] = []
    for t in range(ticks):
        for g in gens:
            g.last_seen = float(t)
            g.weights_version = trainer.version
        trainer.pending_groups = len(held)
        before = {g.instance: g.granted for g in gens}
        plan = plan_balanced(gens, trainer, batch_groups=batch_groups, max_staleness=max_staleness, now=float(t),
                             max_outstanding=max_outstanding, speeds=speed_map, kept_fraction=kept_hat, **KW)
        assert plan.allowed_total == plan.trained_bound + plan.oversample
        assert plan.trained_bound == allowed_started(trainer, batch_groups=batch_groups, max_staleness=max_staleness)
        assert all(g.granted >= before[g.instance] for g in gens)  # grants never shrink
        if sum(plan.grants.values()) > sum(before.values()):
            # New grants only within the plan's total.  (With over-sampling the total itself may dip
            # below what was granted earlier, when more groups than expected pass the filter.)
            assert sum(plan.grants.values()) <= plan.allowed_total
        if kept_hat == 1.0:
            assert sum(plan.grants.values()) <= plan.allowed_total
        for g, sp in zip(gens, speeds, strict=True):
            n = min(sp, g.granted - g.started)
            for _ in range(n):
                running.append((t + latency, index, trainer.version, g))
                index += 1
            g.started += n
        done = [r for r in running if r[0] <= t]
        running = [r for r in running if r[0] > t]
        for _, i, v0, g in sorted(done, key=lambda r: r[1]):
            g.published += 1
            if math.floor((i + 1) * kept) > math.floor(i * kept):
                held.append(v0)
            else:
                trainer.dropped_groups += 1
        if len(held) >= batch_groups:  # one step per tick
            batch, held = held[:batch_groups], held[batch_groups:]
            staleness += [trainer.version - v0 for v0 in batch]
            trainer.version += 1
            trainer.trained_groups += batch_groups
    return {"staleness": staleness, "version": trainer.version, "gens": gens}


@st.composite
def fifo_cases(draw):
    kept = draw(st.sampled_from([0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0]))
    return dict(batch_groups=draw(st.integers(1, 8)), max_staleness=draw(st.integers(0, 3)), kept=kept,
                kept_hat=draw(st.floats(kept, 1.0)), latency=draw(st.integers(0, 4)),
                speeds=draw(st.lists(st.integers(0, 12), min_size=1, max_size=4)), ticks=draw(st.integers(5, 60)),
                max_outstanding=draw(st.integers(1, 30)),
                rates=None if draw(st.booleans()) else draw(st.lists(st.floats(0.0, 10.0), min_size=4, max_size=4)))


@settings(max_examples=200, deadline=None)
@given(fifo_cases())
def test_rate_aware_split_and_oversampling_never_train_beyond_the_bound(case):
    """Whatever the generators' speeds and measured rates, with a kept fraction that is not
    optimistic (k_hat >= k), cumulative starts stay within the plan and no kept group is trained
    beyond ``max_staleness``."""
    rates = case.pop("rates")
    out = fifo_run(**case, rates=None if rates is None else rates[: len(case["speeds"])])
    assert all(s <= case["max_staleness"] for s in out["staleness"]), out["staleness"]
    for g in out["gens"]:
        assert g.outstanding <= case["max_outstanding"]


def test_an_optimistic_kept_fraction_would_break_the_bound():
    """The property above can fail: over-sampling for a filter rate that is not there overshoots."""
    case = dict(batch_groups=4, max_staleness=1, latency=2, speeds=[8, 8], ticks=40)
    assert max(fifo_run(kept=1.0, kept_hat=1.0, **case)["staleness"]) <= 1
    assert max(fifo_run(kept=1.0, kept_hat=0.5, **case)["staleness"]) > 1


def test_oversampling_compensates_the_filter_rate():
    """Half the groups are filtered: starting 2x as many keeps the trainer fed at the same bound."""
    case = dict(batch_groups=8, max_staleness=1, kept=0.5, latency=3, speeds=[6, 6, 6, 6], ticks=60)
    plain = fifo_run(kept_hat=1.0, **case)
    over = fifo_run(kept_hat=0.5, **case)
    assert over["version"] >= 1.5 * plain["version"]
    assert max(over["staleness"]) <= 1
    # The extra is exactly the expected filtered share of the free window.
    trainer = TrainerView(version=3, pending_groups=4)
    assert oversample_extra(trainer, batch_groups=8, max_staleness=1, kept_fraction=0.5) == 16 - 4
    assert oversample_extra(trainer, batch_groups=8, max_staleness=1, kept_fraction=1.0) == 0
    assert oversample_extra(trainer, batch_groups=8, max_staleness=1, kept_fraction=0.01, max_factor=4) == 12 * 3
    assert oversample_extra(trainer, batch_groups=8, max_staleness=1, kept_fraction=math.nan) == 0
    with pytest.raises(ValueError, match="max_factor"):
        oversample_extra(trainer, batch_groups=8, max_staleness=1, kept_fraction=0.5, max_factor=0.5)


def test_a_slow_generator_gets_proportionally_less():
    gens = [GeneratorView(f"g{i}", "b", last_seen=0.0) for i in range(4)]
    speeds = {"g0": Speed(rate=1.0), "g1": Speed(rate=3.0), "g2": Speed(rate=3.0), "g3": Speed(rate=3.0)}
    plan = plan_balanced(gens, TrainerView(), batch_groups=40, max_staleness=0, now=0.0, max_outstanding=100,
                         speeds=speeds, **KW)
    assert plan.grants == {("g0", "b"): 4, ("g1", "b"): 12, ("g2", "b"): 12, ("g3", "b"): 12}


def test_with_known_slots_work_goes_to_free_slots_first_and_a_3x_slower_generator_holds_little():
    gens = [GeneratorView(f"g{i}", "b", last_seen=0.0) for i in range(4)]
    speeds = {g.instance: Speed(rate=4.0, latency_s=2.0, slots=8) for g in gens}
    speeds["g0"] = Speed(rate=4 / 3, latency_s=6.0, slots=8)
    kw = dict(max_staleness=0, now=0.0, max_outstanding=100, speeds=speeds, **KW)
    # 24 groups fit the fast generators' free slots: the slow one only gets its probe.
    plan = plan_balanced([replace(g) for g in gens], TrainerView(), batch_groups=25, **kw)
    assert plan.grants[("g0", "b")] == 1 and sum(plan.grants.values()) == 25
    # Beyond their slots the fast ones queue until waiting there is as slow as the slow one: 2 x 8 more each.
    plan = plan_balanced([replace(g) for g in gens], TrainerView(), batch_groups=80, **kw)
    fast = [plan.grants[(f"g{i}", "b")] for i in (1, 2, 3)]
    assert all(23 <= f <= 25 for f in fast) and plan.grants[("g0", "b")] <= 80 - sum(fast)
    assert plan.grants[("g0", "b")] * 3 <= min(fast)


def test_latency_is_compared_within_a_pool():
    """Long tasks take long: a generator on the slow pool is not penalised for it."""
    gens = [GeneratorView(f"g{i}", "b", last_seen=0.0) for i in range(4)]
    speeds = {"g0": Speed(rate=4, latency_s=2.0, slots=8, pool="math"), "g1": Speed(rate=4, latency_s=2.0, slots=8, pool="math"),
              "g2": Speed(rate=2, latency_s=4.0, slots=8, pool="code"), "g3": Speed(rate=2, latency_s=4.0, slots=8, pool="code")}
    plan = plan_balanced(gens, TrainerView(), batch_groups=32, max_staleness=0, now=0.0, max_outstanding=100,
                         speeds=speeds, **KW)
    assert set(plan.grants.values()) == {8}


def test_a_generator_on_old_weights_waits_for_the_new_ones():
    trainer = TrainerView(version=5, dropped_groups=0)
    fresh = GeneratorView("a", "b", last_seen=0.0, started=5 * 4, granted=5 * 4, published=20, weights_version=5)
    behind = GeneratorView("z", "b", last_seen=0.0, started=0, published=0, granted=0, weights_version=4)
    # 8 free slots at s=1, B=4; the generator one version behind is by far the faster, yet may only
    # use what the window held at v4: 4 slots fewer.
    speeds = {"a": Speed(rate=1.0), "z": Speed(rate=100.0)}
    plan = plan_balanced([fresh, behind], trainer, batch_groups=4, max_staleness=1, now=0.0, max_outstanding=100,
                         speeds=speeds, **KW)
    assert plan.allowed_total - sum(plan.grants.values()) == 0
    assert plan.grants[("z", "b")] <= 4 and plan.grants[("a", "b")] >= 24
    # Once its weights arrive it is preferred again.
    behind.weights_version = trainer.version = 6
    plan = plan_balanced([fresh, behind], trainer, batch_groups=4, max_staleness=1, now=0.0, max_outstanding=100,
                         speeds=speeds, **KW)
    assert plan.grants[("z", "b")] >= 4 + 3


def test_rate_aware_split_without_measurements_is_the_plain_water_filling():
    gens = [GeneratorView(f"g{i}", "x") for i in range(3)]
    plan = plan_balanced(gens, TrainerView(), batch_groups=11, max_staleness=0, now=0.0, max_outstanding=64, **KW)
    grants = sorted(plan.grants.values())
    assert sum(grants) == 11 and grants[-1] - grants[0] <= 1


@pytest.mark.parametrize("planner", [plan_admission, plan_balanced])
def test_a_silent_generator_is_named_in_the_reason_once(planner):
    a = GeneratorView("gen-a", "1", last_seen=0.0)
    b = GeneratorView("gen-b", "1", last_seen=0.0, started=3, published=1, granted=5)
    kw = dict(batch_groups=4, max_staleness=1, silent_after=5.0, max_outstanding=64)
    plan = planner([a, b], TrainerView(), now=0.0, **kw)
    assert plan.lost == [] and "silent" not in plan.reason
    a.last_seen = 9.0
    plan = planner([a, b], TrainerView(), now=9.0, **kw)
    assert plan.lost == ["gen-b/1"]
    assert "re-planned without 1 newly silent: gen-b/1 silent 9.0s: took back 2 unstarted, 2 unpublished" in plan.reason
    assert plan.grants[("gen-b", "1")] == 1  # only what it published still counts
    a.last_seen = 10.0
    plan = planner([a, b], TrainerView(), now=10.0, **kw)
    assert plan.lost == [] and "silent=1" in plan.reason


# -- pool routing -------------------------------------------------------------------------------


def routing_run(target_before: dict[str, float], target_after: dict[str, float], rounds: int, change_at: int,
                cost: dict[str, float], kept: dict[str, float], n_gens: int = 8) -> list[dict[str, float]]:
    """Each round a generator produces 1/cost groups of its first pool, of which a share kept trains."""
    gens = [GeneratorView(f"gen-{i}", "b") for i in range(n_gens)]
    routes: dict[str, list[str]] = {}
    trained = {p: 0.0 for p in cost}
    base = dict(trained)
    mixes = []
    for r in range(rounds):
        target = target_before if r < change_at else target_after
        if r == change_at:
            base = dict(trained)
        since = {p: int(trained[p] - base[p]) for p in trained}
        routes = assign_pools(gens, target, since, {p: 1000 for p in cost}, current=routes, kept_by_pool=kept)
        produced = {p: 0.0 for p in cost}
        for g in gens:
            produced[routes[g.instance][0]] += 4.0 / cost[routes[g.instance][0]]
        for p in cost:
            trained[p] += produced[p] * kept[p]
        total = sum(produced[p] * kept[p] for p in cost)
        mixes.append({p: produced[p] * kept[p] / total for p in cost})
    return mixes


def test_pool_routing_follows_a_new_target_mix_within_bounded_time():
    """Code groups cost 2x and are filtered more; the router is not told the cost, only the mix it gets."""
    cost, kept = {"math": 1.0, "code": 2.0}, {"math": 0.6, "code": 0.5}
    mixes = routing_run({"math": 0.7, "code": 0.3}, {"math": 0.4, "code": 0.6}, rounds=120, change_at=40,
                        cost=cost, kept=kept)

    def window(a: int, b: int) -> float:
        return sum(m["code"] for m in mixes[a:b]) / (b - a)

    assert abs(window(20, 40) - 0.3) <= 0.05  # before: on target
    assert abs(window(40, 45) - 0.3) > 0.1  # just after the change: off target
    # Within 20 rounds every 10-round window of the trained mix is on the new target.
    assert all(abs(window(a, a + 10) - 0.6) <= 0.05 for a in range(60, 110))


def test_assign_pools_routing_details():
    gens = [GeneratorView(f"g{i}", "b") for i in range(4)]
    routes = assign_pools(gens, {"math": 0.5, "code": 0.5}, {}, {})
    assert sorted(r[0] for r in routes.values()) == ["code", "code", "math", "math"]
    assert all(sorted(r) == ["code", "math"] for r in routes.values())  # the other pool as fallback
    # A small shift moves only the generator at the boundary, not everyone.
    moved = assign_pools(gens, {"math": 0.6, "code": 0.4}, {}, {}, current=routes)
    assert sum(moved[g][0] != routes[g][0] for g in routes) <= 1
    # An empty backlog gets no capacity while another pool has work.
    dry = assign_pools(gens, {"math": 0.5, "code": 0.5}, {}, {"code": 0, "math": 10}, fallback=False)
    assert all(r == ["math"] for r in dry.values())
    # Silent generators are not routed.
    gens[0].alive = False
    assert "g0" not in assign_pools(gens, {"math": 1.0}, {}, {})
    with pytest.raises(ValueError, match="no pool with a positive share"):
        assign_pools(gens, {"math": 0.0}, {}, {})


# -- measurements -------------------------------------------------------------------------------


def test_balance_state_measures_consumption_production_kept_and_effective():
    state = BalanceState(tau_s=10.0)
    for t in range(0, 61):
        # 4 groups/s published by one generator, 2 by another (which then idles: not slower for it).
        state.observe_generator("fast", float(t), started=4 * t + 8, published=4 * t, slots=16)
        state.observe_generator("slow", float(t), started=min(2 * t, 60) + (4 if t < 30 else 0),
                                published=min(2 * t, 60))
        math_train, code_train = 2 * t, t
        state.observe_trainer(float(t), trained_total=3 * t, idle_s=0.25 * t,
                              by_pool={"math": {"train": math_train, "filtered": t, "stale": 0},
                                       "code": {"train": code_train, "filtered": t, "stale": t // 2,
                                                STALE_HELD: t // 4}},
                              by_generator={"fast": {"train": 2 * t, "stale": 0}, "slow": {"train": t, "stale": t}})
    sig = state.signals()
    assert sig.consumption == pytest.approx(3.0, rel=0.02)
    assert sig.trainer_idle == pytest.approx(0.25, rel=0.02)
    assert sig.generator_speeds["fast"].rate == pytest.approx(4.0, rel=0.02)
    assert sig.generator_speeds["fast"].latency_s == pytest.approx(2.0, rel=0.05)  # 8 running / 4 per s
    assert sig.generator_speeds["fast"].slots == 16
    assert sig.generator_speeds["slow"].rate == pytest.approx(2.0, rel=0.05)  # its idle half does not count
    assert sig.generator_speeds["slow"].fresh == pytest.approx(0.5, rel=0.02)
    assert sig.production == pytest.approx(6.0, rel=0.05)
    math_sig, code_sig = sig.pools["math"], sig.pools["code"]
    assert math_sig.kept_fraction == pytest.approx(2 / 3, rel=0.02)
    assert math_sig.usable_fraction == pytest.approx(2 / 3, rel=0.02)
    # code: per second 1 train + 1 filtered + 0.5 stale, of which 0.25 went stale while held (had passed the filter).
    assert code_sig.kept_fraction == pytest.approx(1.25 / 2.25, rel=0.03)
    assert code_sig.usable_fraction == pytest.approx(1.25 / 2.5, rel=0.03)
    assert code_sig.usable_fraction_upper > code_sig.usable_fraction
    assert sig.effective == pytest.approx(sig.production * 3 / 5.5, rel=0.05)
    assert sig.usable_upper_for({"math": 1.0}) == pytest.approx(math_sig.usable_fraction_upper)
    assert set(sig.as_metrics()) >= {"controller/balance/consumption", "controller/pool/code/kept_fraction"}


def test_balance_state_survives_restarts_and_tracks_the_mix_since_the_target():
    state = BalanceState(tau_s=5.0)
    state.observe_trainer(0.0, trained_total=100, by_pool={"math": {"train": 100}})
    state.set_target_mix({"math": 0.5, "code": 0.5})
    state.observe_trainer(1.0, trained_total=110, by_pool={"math": {"train": 106}, "code": {"train": 4}})
    assert state.trained_since_target() == {"math": 6, "code": 4}
    # The trainer restarts: its counters start again from zero; rates stay sane (no negative rate).
    state.observe_trainer(2.0, trained_total=3, by_pool={"math": {"train": 2}, "code": {"train": 1}})
    assert state.signals().consumption > 0
    # A new generator boot does not count as a huge burst.
    state.observe_generator("g", 0.0, started=500, published=500, boot="a")
    state.observe_generator("g", 1.0, started=504, published=502, boot="a")
    state.observe_generator("g", 2.0, started=2, published=1, boot="b")
    state.observe_generator("g", 3.0, started=6, published=4, boot="b")
    assert state.signals().generator_speeds["g"].rate < 5


def test_wilson_upper_bound():
    assert wilson_upper(0.5, 0) == 1.0
    assert 0.5 < wilson_upper(0.5, 100) < 0.61
    assert wilson_upper(0.5, 10_000) == pytest.approx(0.51, abs=0.002)


# -- the simulator --------------------------------------------------------------------------------


def test_simulator_adaptive_beats_static_and_never_trains_beyond_the_bound():
    sc = Scenario()
    f = 300.0 / sc.duration
    sc = replace(sc, duration=300.0, t_slow=sc.t_slow * f, t_mix=sc.t_mix * f, t_trainer=sc.t_trainer * f, settle_s=30.0)
    out = compare(sc, seed=3, policies=("static", "adaptive"))
    ad, static = out["policies"]["adaptive"], out["policies"]["static"]
    assert ad["trained_beyond_bound"] == 0 and static["trained_beyond_bound"] == 0
    assert ad["staleness_max"] <= sc.max_staleness
    assert out["utilisation_ratio_adaptive_over_static"] >= 1.15
    assert ad["trainer_idle_after_adapting"] < static["trainer_idle_after_adapting"]
    assert ad["trainer_idle_after_adapting"] <= 0.08
    last = ad["phases"][-1]
    assert abs(last["trained_mix"]["code"] - sc.mix_after["code"]) <= 0.07
    # Deterministic under a seed.
    again = compare(sc, seed=3, policies=("adaptive",))
    assert again["policies"]["adaptive"] == ad


def test_the_mix_is_judged_on_what_generators_published_until_the_trainer_reports_per_pool_counts():
    state = BalanceState(tau_s=10.0)
    for t in range(0, 21):
        # Nothing judged yet (the first batch is still arriving): no outcome breakdown, no pool signals.
        state.observe_generator("gen-0", float(t), started=3 * t + 3, published=3 * t, boot="x")
        state.observe_generator("gen-1", float(t), started=t + 1, published=t, boot="y")
        state.observe_trainer(float(t), trained_total=0, by_pool={})
        state.observe_published_by_pool({"a": 3 * t, "b": t})
    sig = state.signals()
    assert sig.pools == {} and math.isnan(sig.kept_fraction) and sig.production == pytest.approx(4.0, rel=0.05)
    assert state.mix_source == "generators" and state.trained_by_pool == {"a": 60, "b": 20}
    # Once the trainer reports per-pool counts they replace the stand-in.
    state.observe_trainer(21.0, trained_total=42, by_pool={"a": {"train": 30}, "b": {"train": 12}})
    assert state.mix_source == "trainer" and state.trained_by_pool == {"a": 30, "b": 12}


def test_a_restarted_trainer_process_does_not_count_negative_outcomes():
    state = BalanceState(tau_s=10.0)
    for t in range(10):
        state.observe_trainer(float(t), trained_total=10 * t, by_pool={"a": {"train": 10 * t, "filtered": 10 * t}})
    state.restart_trainer()  # counters of the new process start from zero; trained_total resumes
    for t in range(10, 20):
        state.observe_trainer(float(t), trained_total=100 + 10 * (t - 10),
                              by_pool={"a": {"train": 10 * (t - 10), "filtered": 10 * (t - 10)}})
    assert state.signals().kept_fraction == pytest.approx(0.5, abs=1e-6)
