"""The generator core's rules for the controller's typed decisions (no bus, no model).

Decisions of one kind apply in seq order (pause, resume and drain are one kind); one that names a
boot applies to that boot only; the newest admit holds, also when lower, but never below what
started; a drain gives the unstarted grant back and voids older admits; pools outside the
replica's own are refused; concurrency is capped by the replica's config.
"""

from __future__ import annotations

from typing import Any

from rlbus.bus.subjects import Subjects
from rlbus.schemas import Admit, AssignPools, Concurrency, Control, Decision, Evaluate, RunState, SetMix
from rlbus.services.generator.control import ControlFollower
from rlbus.services.generator.core import Generator
from rlbus.services.generator.settings import GeneratorSettings


class FakeBackend:
    version = 0
    slowdown = 1.0
    eos_id = None

    def metrics(self) -> dict[str, float]:
        return {}


def core(pools: tuple[str, ...] = ("a", "b"), **kw: Any) -> Generator:
    return Generator(FakeBackend(), GeneratorSettings(instance="gen-0", max_batch_groups=8, **kw), list(pools))  # type: ignore[arg-type]


def ctl(seq: int, decision: Decision, instance: str = "gen-0") -> Control:
    return Control(seq=seq, decision=decision, target_service="generator", target_instance=instance)


def test_admits_apply_to_their_boot_only_in_seq_order_and_never_below_started() -> None:
    g = core()
    assert g.on_control(ctl(5, Admit(boot="other", grant_total=9))) is None
    assert g.on_control(ctl(5, Admit(boot=g.boot, grant_total=9, min_version=2))) is not None
    assert (g.grant_total, g.min_version, g.budget) == (9, 2, 0)  # on v0, below the freshness floor
    assert g.on_control(ctl(4, Admit(boot=g.boot, grant_total=20))) is None  # older: ignored
    g.started = 8
    g.on_control(ctl(6, Admit(boot=g.boot, grant_total=7, min_version=1)))
    assert g.grant_total == 8, "the newest grant holds (unstarted groups taken back), never below what started"
    assert g.min_version == 2, "the freshness floor never goes down"
    off = core(admission=False)
    assert off.on_control(ctl(7, Admit(boot=off.boot, grant_total=3))) is None and off.budget > 1 << 40


def test_a_drain_gives_the_unstarted_grant_back_and_voids_older_admits() -> None:
    g = core()
    g.on_control(ctl(1, Admit(boot=g.boot, grant_total=10)))
    g.started = 4
    assert g.on_control(ctl(3, RunState(state="drain"))) is not None
    assert (g.grant_total, g.state, g.budget) == (4, "drained", 0)
    g.in_flight = 2
    assert g.state == "draining"
    assert g.on_control(ctl(2, Admit(boot=g.boot, grant_total=12))) is None  # issued before the drain
    g.on_control(ctl(4, Admit(boot=g.boot, grant_total=6)))
    assert g.grant_total == 6 and g.budget == 0, "a newer grant holds, but a draining replica starts nothing"
    g.on_control(ctl(5, RunState(state="resume")))
    assert g.budget == 2


def test_pause_resume_and_drain_are_one_kind_in_seq_order() -> None:
    g = core()
    g.on_control(ctl(5, RunState(state="pause")))
    assert g.on_control(ctl(4, RunState(state="resume"))) is None and g.state == "paused"
    assert g.on_control(ctl(3, RunState(state="drain"))) is None and g.state == "paused"
    assert g.on_control(ctl(9, RunState(state="drain", boot="dead-boot"))) is None and g.state == "paused"
    g.on_control(ctl(6, RunState(state="resume", boot=g.boot)))
    assert g.state == "running"
    # Kinds are ordered apart: an admit with a lower seq than the last pause still applies.
    assert g.on_control(ctl(1, Admit(boot=g.boot, grant_total=3))) is not None


def test_pools_outside_the_config_are_refused_and_concurrency_is_capped() -> None:
    g = core()
    assert g.on_control(ctl(1, AssignPools(pools=["c"]))) is None and g.pools == ["a", "b"]
    g.on_control(ctl(2, AssignPools(pools=["b", "a", "c"], shares={"b": 0.75, "a": 0.25, "c": 1.0})))
    assert (g.pools, g.shares) == (["b", "a"], {"b": 0.75, "a": 0.25})
    assert g.on_control(ctl(3, Concurrency(max_groups=100))) is not None and g.batch_cap == 8
    g.on_control(ctl(4, Concurrency(max_groups=2)))
    assert g.batch_cap == 2
    # A record of a held-out round and the controller's own decisions change nothing here.
    assert g.on_control(ctl(5, Evaluate(version=3, tasks=10), "all")) is None
    assert g.on_control(ctl(6, SetMix(mix={"a": 1.0}))) is None


def test_routed_shares_split_the_room_by_what_each_pool_was_given() -> None:
    g = core()
    g.on_control(ctl(1, AssignPools(pools=["b", "a"], shares={"b": 0.8, "a": 0.2})))
    assert g.split_room(5) == [("b", 4), ("a", 1)]
    for pool, n in g.split_room(5):
        g.note_taken(pool, n)
    assert g.split_room(5) == [("b", 4), ("a", 1)]
    g.on_control(ctl(2, AssignPools(pools=["a", "b"])))  # no shares: the first pool with work
    assert g.split_room(3) == [("a", 3)]


def test_a_decision_found_on_another_subject_is_misplaced() -> None:
    s = Subjects("test")
    f = ControlFollower(bus=None, subjects=s, instance="gen-0", gen=core(), status=None)  # type: ignore[arg-type]
    own = s.control_action("generator", "gen-0", "admit")
    admit = ctl(1, Admit(boot="b", grant_total=1))
    assert f.misplaced(admit, own) == ""
    assert "publish it on" in f.misplaced(admit, s.control_action("generator", "gen-0", "concurrency"))
    assert "publish it on" in f.misplaced(ctl(1, Admit(boot="b", grant_total=1), "gen-1"), own)
    other = Control(seq=1, decision=Admit(boot="b", grant_total=1), target_service="trainer", target_instance="gen-0")
    assert "for trainer/gen-0" in f.misplaced(other, own)
    evaluate = ctl(1, Evaluate(version=1, tasks=1), "all")
    assert f.misplaced(evaluate, s.control_action("generator", "all", "evaluate")) == ""
    assert "not for generators" in f.misplaced(ctl(1, SetMix(mix={"a": 1.0})), own)


def test_in_flight_counts_the_batch_and_the_tasks_handed_to_the_episode_driver_once() -> None:
    # One-turn episodes are the default: a heartbeat that counted only the batch driver's tasks would
    # read 0 while the episode engine plays every group (the controller e2e waits on this metric).
    g = core()
    g.begin_batch(n_train=3, n_tasks=3, redelivered=0)
    assert g.metrics()["generator/in_flight"] == 3
    g.hand_over(2)
    g.episode_tasks = 2  # what the episode driver sets as it admits them
    assert g.metrics()["generator/in_flight"] == 3, "each task counted once, wherever it is"
    g.end_batch()
    assert g.metrics()["generator/in_flight"] == 2 and g.metrics()["generator/episode_tasks"] == 2
    g.hand_over(5)
    assert g.in_flight == 0, "never below zero"
