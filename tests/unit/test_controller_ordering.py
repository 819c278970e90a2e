"""One ordering rule for ``Control.seq``: a decision issued later in wall time is never voided by an
earlier one, whoever issued either.

The receiver side is modelled at the level of the seq comparisons a generator applies (the
generator's own tests pin its implementation): decisions of one kind apply in seq order and an older
one is ignored (pause, resume and drain are one kind), and a drain voids the admissions with a lower
seq.  The issuers are the real ones: the controller's ``Planner`` fed with heartbeats, and the
operator's ``rlbus control`` publishing to a bus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rlbus.bus.memory import MemoryBus
from rlbus.schemas import Admit, Control, DecisionClock, Heartbeat, RunState
from rlbus.schemas.metric_keys import GeneratorKeys, TrainerKeys
from rlbus.services.commands.control import send_state
from rlbus.services.controller.planner import Planner
from rlbus.services.controller.settings import ControllerSettings

# The controller starts now (the old rule took its start time from the wall clock); the scenarios
# then run on simulated time from here.
T0 = time.time()
BOOT = "x"


@dataclass
class GeneratorOrdering:
    """What a generator keeps of the decisions it is sent, by seq alone."""

    last: dict[str, int] = field(default_factory=dict)  # per kind of decision
    grant_floor: int = -1  # admissions below the last drain's seq are void
    grant_total: int = 0
    mode: str = "running"

    def apply(self, ctl: Control) -> bool:
        d = ctl.decision
        if ctl.seq <= self.last.get(d.KIND, -1):
            return False
        if isinstance(d, Admit):
            if ctl.seq < self.grant_floor:
                return False
            self.grant_total = d.grant_total
        elif isinstance(d, RunState):
            if d.state == "drain":
                self.grant_floor = ctl.seq
            self.mode = {"pause": "paused", "resume": "running", "drain": "draining"}[d.state]
        self.last[d.KIND] = ctl.seq
        return True


class OldCounter(DecisionClock):
    """The rule this replaced: microseconds at the issuer's start, +1 per decision, nothing observed."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.last = int(start * 1e6)

    def observe(self, seq: int) -> None:
        pass

    def next(self, now: float | None = None) -> int:
        self.last += 1
        return self.last


def heartbeats(p: Planner, t: float, *, version: int, state: str = "running", trainer: str = "running") -> None:
    G, T = GeneratorKeys, TrainerKeys
    p.state.observe(Heartbeat(service="trainer", instance="trainer-0", seq=int(t), ts=t, state=trainer,
                              version=version, metrics={T.VERSION: version}), now=t)
    p.state.observe(Heartbeat(service="generator", instance="gen-0", seq=int(t), ts=t, state=state, version=version,
                              metrics={G.GROUPS_STARTED: 0, G.GROUPS_PUBLISHED: 0, G.CONCURRENCY: 8},
                              info={G.INFO_BOOT: BOOT, G.INFO_POOLS: ["a"], G.INFO_MAX_BATCH_GROUPS: 8}), now=t)


def controller(clock: DecisionClock | None = None) -> Planner:
    cfg = ControllerSettings(refresh=1000.0)
    return Planner(cfg, ["a"], batch_groups=4, max_staleness=1, **({"clock": clock} if clock else {}))


async def operator(bus: MemoryBus, p: Planner, gen: GeneratorOrdering, state: str, at: float) -> Control:
    """``rlbus control <state> gen-0`` at wall time ``at``; the generator and the controller's CONTROL
    watch both see it."""
    ctl = await send_state(bus, state, "gen-0", now=at)  # type: ignore[arg-type]
    assert gen.apply(ctl)
    p.observe(ctl)
    return ctl


async def drain_then_resume_then_admit(p: Planner) -> tuple[GeneratorOrdering, list[Control]]:
    gen, bus = GeneratorOrdering(), MemoryBus("r")
    heartbeats(p, T0 + 1, version=0)
    for ctl in p.step(T0 + 1):
        gen.apply(ctl)
    assert gen.grant_total == (0 + 1 + 1) * 4
    await operator(bus, p, gen, "drain", T0 + 100)
    await operator(bus, p, gen, "resume", T0 + 150)
    heartbeats(p, T0 + 151, version=1)  # running again, and the trainer moved on: the window grew
    later = [c for c in p.step(T0 + 151) if isinstance(c.decision, Admit)]
    assert later and later[0].decision.grant_total == (1 + 1 + 1) * 4
    return gen, later


async def test_admissions_issued_after_an_operator_drain_and_resume_apply():
    gen, later = await drain_then_resume_then_admit(controller())
    assert all(gen.apply(c) for c in later)
    assert gen.grant_total == 12 and gen.mode == "running"


async def test_a_controller_resume_issued_after_an_operator_pause_applies():
    p, gen, bus = controller(), GeneratorOrdering(), MemoryBus("r")
    heartbeats(p, T0 + 1, version=3, trainer="done")
    pauses = [c for c in p.step(T0 + 1) if c.action == "pause"]
    assert pauses and all(gen.apply(c) for c in pauses)
    await operator(bus, p, gen, "pause", T0 + 100)  # an operator pauses it too, meanwhile
    heartbeats(p, T0 + 200, version=3, state="paused")  # a new trainer runs
    resumes = [c for c in p.step(T0 + 200) if c.action == "resume"]
    assert resumes and all(gen.apply(c) for c in resumes) and gen.mode == "running"


async def test_an_operator_decision_sorts_after_the_controllers_even_when_its_clock_is_behind():
    p, gen, bus = controller(), GeneratorOrdering(), MemoryBus("r")
    heartbeats(p, T0 + 1, version=3, trainer="done")
    for ctl in p.step(T0 + 1):  # a pause, as the controller's clock reads it
        await bus.publish(bus.subjects.control_action(ctl.target_service, ctl.target_instance, ctl.action),
                          ctl.encode(), msg_id=ctl.msg_id)
        gen.apply(ctl)
    assert gen.mode == "paused"
    # The operator's clock is 31 s behind: its seq still sorts after the pause it read off CONTROL.
    await operator(bus, p, gen, "resume", T0 - 30)
    assert gen.mode == "running"


async def test_the_scenario_catches_the_old_rule():
    """With the old counter the controller's later admissions sort before the operator's drain and
    are void: the generator would hold a zero grant until the controller restarts."""
    gen, later = await drain_then_resume_then_admit(controller(OldCounter(T0)))
    assert not any(gen.apply(c) for c in later)
