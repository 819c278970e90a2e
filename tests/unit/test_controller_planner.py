"""The controller's decisions from heartbeats (planner + state), and the generator's side of them.

No bus here (but for the operator's command): heartbeats go into ``Planner.state`` and the typed
decisions ``Planner.step`` returns are fed to a real ``Generator`` core, as the services do over CONTROL.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from rlbus.schemas import Admit, AssignPools, Concurrency, Control, Decision, Heartbeat, RunState, SetMix
from rlbus.schemas.metric_keys import GeneratorKeys, TrainerKeys
from rlbus.services.controller.planner import MixError, Planner
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.controller.state import ControllerState, trainer_outcomes
from rlbus.services.generator.core import Generator
from rlbus.services.generator.settings import GeneratorSettings


class FakeBackend:
    version = 0
    slowdown = 1.0
    eos_id = None

    def metrics(self) -> dict[str, float]:
        return {}


def gen_core(pools=("a", "b"), **kw: Any) -> Generator:
    return Generator(FakeBackend(), GeneratorSettings(instance="gen-0", max_batch_groups=8, **kw), list(pools))


def ctl(seq: int, decision: Decision) -> Control:
    return Control(seq=seq, decision=decision, target_service="generator", target_instance="gen-0")


def gen_hb(instance: str, ts: float, *, boot: str, started: int, published: int, seq: int = 1, state: str = "running",
           pools: list[str] | None = None, concurrency: int = 8, version: int = 0, by_pool: dict[str, int] | None = None,
           shares: dict[str, float] | None = None) -> Heartbeat:
    G = GeneratorKeys
    metrics = {G.GROUPS_STARTED: started, G.GROUPS_PUBLISHED: published, G.CONCURRENCY: concurrency,
               G.GROUPS_PER_S: 1.0, **{G.pool_published(p): n for p, n in (by_pool or {}).items()}}
    return Heartbeat(service="generator", instance=instance, seq=seq, ts=ts, state=state, version=version,
                     metrics=metrics, info={G.INFO_BOOT: boot, G.INFO_POOLS: pools or ["a"],
                                            G.INFO_MAX_BATCH_GROUPS: 8, G.INFO_SHARES: shares or {}})


def trainer_hb(ts: float, *, seq: int, version: int = 0, trained: int = 0, state: str = "running",
               by_pool: dict[str, dict[str, int]] | None = None, by_gen: dict[str, dict[str, int]] | None = None,
               idle_s: float | None = None) -> Heartbeat:
    """A trainer heartbeat as the trainer emits it: totals, and the outcome breakdown per pool and
    per generator (per-process counters from zero)."""
    T = TrainerKeys
    metrics = {T.VERSION: version, T.GROUPS_TRAINED_TOTAL: trained, T.GROUPS_DROPPED_TOTAL: 0}
    for pool, counts in (by_pool or {}).items():
        for outcome, n in counts.items():
            metrics[T.pool_groups(pool, outcome)] = n
            metrics[T.groups(outcome)] = metrics.get(T.groups(outcome), 0) + n
    for inst, counts in (by_gen or {}).items():
        for outcome, n in counts.items():
            metrics[T.generator_groups(inst, outcome)] = n
    if idle_s is not None:
        metrics[T.IDLE_S] = idle_s
    return Heartbeat(service="trainer", instance="trainer-0", seq=seq, ts=ts, state=state, version=version,
                     metrics=metrics)


def planner(**kw: Any) -> Planner:
    return Planner(ControllerSettings(route_period=1.0, refresh=100.0, **kw), ["a", "b"], batch_groups=4,
                   max_staleness=1)


# -- the generator's side ---------------------------------------------------------------------------


def test_admits_apply_to_their_boot_only_and_in_seq_order():
    g = gen_core()
    assert g.on_control(ctl(5, Admit(boot="other", grant_total=9))) is None
    assert g.on_control(ctl(5, Admit(boot=g.boot, grant_total=9, min_version=2))) is not None
    assert (g.grant_total, g.min_version) == (9, 2)
    assert g.on_control(ctl(4, Admit(boot=g.boot, grant_total=20))) is None  # older: ignored
    g.started = 8
    g.on_control(ctl(6, Admit(boot=g.boot, grant_total=7)))
    assert g.grant_total == 8  # the newest grant holds (unstarted groups taken back), never below what started
    off = gen_core(admission=False)
    assert off.on_control(ctl(7, Admit(boot=off.boot, grant_total=3))) is None and off.budget > 1 << 40


def test_drain_gives_the_unstarted_grant_back_and_voids_older_admits():
    g = gen_core()
    g.on_control(ctl(1, Admit(boot=g.boot, grant_total=10)))
    g.started, g.in_flight = 4, 2
    g.on_control(ctl(2, RunState(state="drain")))
    assert g.grant_total == 4 and g.budget == 0 and g.state == "draining"
    g.in_flight = 0
    assert g.state == "drained"
    g.on_control(ctl(3, RunState(state="resume")))
    assert g.state == "running" and g.budget == 0
    g.on_control(ctl(4, Admit(boot=g.boot, grant_total=6)))
    assert g.budget == 2
    # pause/resume/drain are one kind: an older pause replayed later does not undo the resume.
    assert g.on_control(ctl(2, RunState(state="pause"))) is None and g.state == "running"
    # A drain addressed to an earlier boot (the controller found that one silent) is not ours.
    assert g.on_control(ctl(9, RunState(state="drain", boot="dead-boot"))) is None and g.state == "running"


def test_routing_and_concurrency_are_kept_within_what_the_replica_serves():
    g = gen_core(pools=("a", "b"))
    assert g.on_control(ctl(1, AssignPools(pools=["c"]))) is None  # not a pool it serves
    g.on_control(ctl(2, AssignPools(pools=["b", "a", "c"], shares={"b": 0.75, "a": 0.25, "c": 1.0})))
    assert g.pools == ["b", "a"] and g.shares == {"b": 0.75, "a": 0.25}
    g.on_control(ctl(3, Concurrency(max_groups=100)))
    assert g.batch_cap == 8
    g.on_control(ctl(4, Concurrency(max_groups=2)))
    assert g.batch_cap == 2


def test_split_room_follows_the_shares_over_batches():
    g = gen_core()
    g.on_control(ctl(1, AssignPools(pools=["b", "a"], shares={"b": 0.8, "a": 0.2})))
    taken = {"a": 0, "b": 0}
    for room in [1, 3, 2, 1, 5, 8, 1, 4, 3, 2]:
        split = g.split_room(room)
        assert sum(n for _, n in split) == room
        for p, n in split:
            g.note_taken(p, n)
            taken[p] += n
    assert abs(taken["a"] / sum(taken.values()) - 0.2) <= 0.04
    assert g.split_room(0) == []
    g.on_control(ctl(2, AssignPools(pools=["a", "b"])))  # no shares: the first pool with work
    assert g.split_room(4) == [("a", 4)]


# -- the controller's state -------------------------------------------------------------------------


def test_trainer_outcomes_come_from_the_breakdown_keys():
    by_pool, by_gen = trainer_outcomes({"trainer/pool/a/groups_train": 3, "trainer/pool/b/groups_filtered": 2,
                                        "trainer/pool/a/groups_stale_held": 1,
                                        "trainer/generator/gen-0/groups_stale": 1, "trainer/groups_train": 3})
    assert by_pool == {"a": {"train": 3, "stale_held": 1}, "b": {"filtered": 2}} and by_gen == {"gen-0": {"stale": 1}}
    # Before the trainer judged a group there is no breakdown, and no outcome to feed.
    assert trainer_outcomes({TrainerKeys.VERSION: 0, TrainerKeys.groups("train"): 0}) == ({}, {})


def test_heartbeats_with_the_outcome_breakdown_drive_kept_fractions_over_sampling_and_routing():
    """The trainer reports each group's outcome per pool and per generator: pool b keeps half of what
    arrives, pool a all of it, and gen-1's groups arrive too late a quarter of the time.  The controller
    measures that, over-samples by it, and asks more capacity of b, whose groups are kept less."""
    p = planner(tau=5.0)
    gens = {"gen-0": dict(boot="x", pools=["a", "b"]), "gen-1": dict(boot="y", pools=["b", "a"])}
    routes: list[Control] = []
    for t in range(0, 30):
        n = 4 * t  # groups each generator published so far
        for name, kw in gens.items():
            p.state.observe(gen_hb(name, float(t), started=n + 4, published=n, by_pool={kw["pools"][0]: n}, **kw),
                            now=float(t))
        p.state.observe(trainer_hb(float(t), seq=t + 1, trained=n + n // 2 - n // 4,
                                   by_pool={"a": {"train": n}, "b": {"train": n // 2 - n // 4, "filtered": n // 2,
                                                                     "stale": n // 4}},
                                   by_gen={"gen-0": {"train": n}, "gen-1": {"train": n // 2 - n // 4,
                                                                            "filtered": n // 2, "stale": n // 4}},
                                   idle_s=0.1 * t), now=float(t))
        routes += of(p.step(float(t)), AssignPools)
    sig = p.signals
    assert set(sig.pools) == {"a", "b"} and p.state.balance.mix_source == "trainer"
    assert sig.pools["a"].kept_fraction == pytest.approx(1.0)
    assert sig.pools["b"].kept_fraction == pytest.approx(1 / 3, abs=0.03)  # stale arrivals are not judged
    assert sig.pools["b"].usable_fraction == pytest.approx(0.25, abs=0.03)  # of all that arrived
    assert sig.generator_speeds["gen-1"].fresh == pytest.approx(0.75, abs=0.03)
    assert sig.trainer_idle == pytest.approx(0.1, abs=0.02)
    assert p.last_plan is not None and p.last_plan.oversample > 0  # the filter's share is started on top
    # An equal target, but b's groups are usable a quarter as often as a's: b needs 4/5 of the capacity
    # for that alone, and more while it is behind in trained groups.
    assert routes[0].inputs["need"] == {"a": 0.5, "b": 0.5}  # nothing measured yet
    assert routes[-1].inputs["need"]["b"] > 0.8 and routes[-1].inputs["trained_since_target"]["b"] > 0


def test_state_marks_draining_generators_and_sums_published_pools_over_boots():
    st = ControllerState(tau_s=5.0)
    st.observe(gen_hb("gen-0", 1.0, boot="x", started=5, published=3, by_pool={"a": 3}), now=1.0)
    st.observe(gen_hb("gen-0", 2.0, boot="y", started=2, published=2, by_pool={"a": 1, "b": 1}, state="draining"),
               now=2.0)
    assert st.generators[("gen-0", "y")].draining and not st.generators[("gen-0", "x")].draining
    assert st.balance.trained_by_pool == {"a": 4, "b": 1}
    assert st.live_instances() == []


# -- the controller's decisions ---------------------------------------------------------------------


def feed(p: Planner, t: float, *, trainer_state: str = "running", gens: dict[str, dict[str, Any]] | None = None,
         version: int = 0) -> None:
    p.state.observe(trainer_hb(t, seq=int(t) + 1, version=version, state=trainer_state), now=t)
    for name, kw in (gens or {}).items():
        p.state.observe(gen_hb(name, t, **kw), now=t)


def of(out: list[Control], kind: type) -> list[Control]:
    return [c for c in out if isinstance(c.decision, kind)]


def test_admissions_are_typed_decisions_with_inputs_reason_and_issuer():
    p = planner()
    feed(p, 1.0, gens={"gen-0": dict(boot="x", started=0, published=0)})
    admit = of(p.step(1.0), Admit)[0]
    assert admit.target_instance == "gen-0" and admit.action == "admit" and admit.issuer == "controller-0"
    assert admit.decision == Admit(boot="x", grant_total=(0 + 1 + 1) * 4)  # the whole window for the only generator
    assert "allowed=(V=0+s=1+1)*B=4" in admit.reason and admit.inputs["trainer_version"] == 0
    assert Control.decode(admit.encode()) == admit  # what goes on the wire is what was decided
    assert not of(p.step(1.1), Admit)  # unchanged: not re-sent


def test_a_silent_generator_is_drained_replanned_and_resumed_when_back():
    p = planner(silent_after=2.0)
    both = {"gen-0": dict(boot="x", started=0, published=0), "gen-1": dict(boot="y", started=0, published=0)}
    feed(p, 1.0, gens=both)
    p.step(1.0)
    before = p.last_plan.grants[("gen-1", "y")]
    feed(p, 4.0, gens={"gen-1": both["gen-1"]})  # gen-0 stopped heartbeating
    out = p.step(4.0)
    drain = [c for c in out if c.action == "drain"]
    assert [c.target_instance for c in drain] == ["gen-0"] and drain[0].decision == RunState(state="drain", boot="x")
    assert "silent for more than 2.0s" in drain[0].reason
    assert p.last_plan.grants[("gen-1", "y")] > before and "gen-0/x" in p.last_plan.lost
    feed(p, 5.0, gens=both)
    resumed = [c for c in p.step(5.0) if c.action == "resume"]
    assert [(c.target_instance, c.decision) for c in resumed] == [("gen-0", RunState(state="resume", boot="x"))]


def test_generators_pause_when_the_trainer_is_done_and_resume_when_it_runs():
    p = planner()
    feed(p, 1.0, trainer_state="done", gens={"gen-0": dict(boot="x", started=0, published=0)})
    pause = [c for c in p.step(1.0) if c.action == "pause"]
    assert len(pause) == 1 and "trainer done" in pause[0].reason
    feed(p, 2.0, trainer_state="running", gens={"gen-0": dict(boot="x", started=0, published=0, state="paused")})
    assert [c.action for c in of(p.step(2.0), RunState)] == ["resume"]


def test_every_decision_sorts_after_the_one_before_and_after_every_seq_seen():
    p = planner()
    feed(p, 1.0, gens={"gen-0": dict(boot="x", started=0, published=0)})
    first = p.step(1.0)
    seqs = [c.seq for c in first]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    ahead = int((time.time() + 3600) * 1e6)  # an operator whose clock runs an hour ahead
    p.observe(Control(seq=ahead, decision=RunState(state="pause"), target_service="generator", issuer="operator"))
    feed(p, 2.0, trainer_state="done", gens={"gen-0": dict(boot="x", started=0, published=0)})
    assert all(c.seq > ahead for c in p.step(2.0))


def test_a_new_target_mix_reroutes_the_generators():
    p = planner()
    gens = {"gen-0": dict(boot="x", started=0, published=0, pools=["a", "b"]),
            "gen-1": dict(boot="y", started=0, published=0, pools=["b", "a"])}
    feed(p, 1.0, gens=gens)
    first = {c.target_instance: c.decision for c in of(p.step(1.0), AssignPools)}
    assert first["gen-0"].pools[0] != first["gen-1"].pools[0]  # 50/50: one each
    mix = Control(seq=10, decision=SetMix(mix={"a": 0.2, "b": 0.8}), target_service="controller", reason="test")
    assert "target mix now" in p.set_mix(mix)
    feed(p, 1.2, gens=gens)
    out = {c.target_instance: c for c in of(p.step(1.2), AssignPools)}
    a_share = sum(c.decision.shares.get("a", 0.0) for c in out.values()) / 2
    assert a_share == pytest.approx(0.2, abs=0.01)
    assert all("need a 0.20, b 0.80" in c.reason and c.inputs["target_mix"] == {"a": 0.2, "b": 0.8}
               for c in out.values())
    assert p.set_mix(mix) is None  # the same request again (a replay) changes nothing
    with pytest.raises(MixError, match="not among the run's train pools"):
        p.set_mix(Control(seq=11, decision=SetMix(mix={"zz": 1.0}), target_service="controller"))
    with pytest.raises(MixError, match="not a mix request"):
        p.set_mix(Control(seq=12, decision=Concurrency(max_groups=2), target_service="controller"))


def test_a_slow_generator_gets_a_lower_concurrency():
    p = planner()
    for t in range(0, 40):
        # gen-0 finishes its 8 groups every second, gen-1 (slowed) one group every 8 seconds.
        feed(p, float(t), gens={"gen-0": dict(boot="x", started=8 * t + 8, published=8 * t),
                                "gen-1": dict(boot="y", started=t // 8 + 1, published=t // 8)})
    out = {c.target_instance: c for c in of(p.step(40.0), Concurrency)}
    assert out["gen-1"].decision.max_groups < 8 and "latency" in out["gen-1"].reason
    assert "gen-0" not in out  # already at its maximum: nothing to say
    m = p.metrics()
    assert m["controller/target/a"] == 0.5 and math.isfinite(m["controller/balance/production"])


# -- the operator's side ---------------------------------------------------------------------------


async def test_an_operator_mix_request_reaches_the_controller_as_a_recorded_decision():
    from rlbus.bus.memory import MemoryBus
    from rlbus.services.commands.control import parse_mix, send_mix, send_state

    bus = MemoryBus("r")
    sent = await send_mix(bus, parse_mix(["a=1", "b=3"]), reason="more of b")
    await send_state(bus, "drain", "gen-0")
    stored = dict(bus.messages("CONTROL"))
    request = Control.decode(stored["rl.r.control.controller.all.set_mix"])
    assert request == sent and request.decision == SetMix(mix={"a": 1.0, "b": 3.0})
    assert request.reason == "more of b" and request.issuer == "operator"
    assert Control.decode(stored["rl.r.control.generator.gen-0.drain"]).decision == RunState(state="drain")
    p = planner()
    assert "target mix now {'a': 0.25, 'b': 0.75}" in p.set_mix(request)
    for bad in (["a"], ["a=x"], ["a=-1"], ["a=0"], ["a=nan"]):
        with pytest.raises(SystemExit):
            parse_mix(bad)
