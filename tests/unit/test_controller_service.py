"""The controller and weight-broadcast services on the in-memory bus: decisions published on their own
subjects with their own ids, ordered after everything already on CONTROL, bad decisions dead-lettered
with the reason while the service keeps going, and held-out rounds scheduled and pinned."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from rlbus.bus.memory import MemoryBus
from rlbus.schemas import Admit, Control, Evaluate, Heartbeat, RunState, SchemaError, SetMix, Task
from rlbus.schemas.metric_keys import GeneratorKeys, TrainerKeys
from rlbus.services.broadcast.service import Broadcaster, BroadcastService
from rlbus.services.broadcast.settings import BroadcastSettings
from rlbus.services.controller.service import Controller, EvalSchedule
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped

RUN = "r"


async def eventually(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within the deadline")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(workers: tuple, life: Lifecycle) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(run_until_stopped(life, *workers))
    await asyncio.sleep(0.05)  # the watches subscribe
    try:
        yield task
    finally:
        life.shutdown()
        await asyncio.wait_for(task, 5)


def decisions(bus: MemoryBus) -> list[tuple[str, Control]]:
    """Every decision on CONTROL that decodes (tests publish some that do not)."""
    out = []
    for s, d in bus.messages("CONTROL"):
        with contextlib.suppress(SchemaError):
            out.append((s, Control.decode(d)))
    return out


async def heartbeats(bus: MemoryBus, *, version: int = 0, seq: int = 1) -> None:
    G, T = GeneratorKeys, TrainerKeys
    for hb in (Heartbeat(service="trainer", instance="trainer-0", seq=seq, ts=time.time(), version=version,
                         metrics={T.VERSION: version}),
               Heartbeat(service="generator", instance="gen-0", seq=seq, ts=time.time(), version=version,
                         metrics={G.GROUPS_STARTED: 0, G.GROUPS_PUBLISHED: 0, G.CONCURRENCY: 8},
                         info={G.INFO_BOOT: "x", G.INFO_POOLS: ["a", "b"], G.INFO_MAX_BATCH_GROUPS: 8})):
        await bus.publish(bus.subjects.metrics(hb.service, hb.instance), hb.encode(), msg_id=hb.msg_id)


def controller(bus: MemoryBus, life: Lifecycle, tmp_path: Any, evals: EvalSchedule | None = None) -> Controller:
    run_cfg = RunSettings(run=RUN, run_dir=str(tmp_path), pools=["a", "b"], batch_groups=4, max_staleness=1)
    return Controller(run_cfg, ControllerSettings(route_period=0.2), bus=bus, life=life,
                      evals=evals or EvalSchedule([], 0))


async def test_decisions_go_out_typed_on_their_subjects_and_after_every_seq_already_on_control(tmp_path):
    bus, life = MemoryBus(RUN), Lifecycle(grace=1.0)
    # An operator on a machine whose clock runs an hour ahead drained gen-0 before this controller started.
    ahead = Control(seq=int((time.time() + 3600) * 1e6), decision=RunState(state="drain"), target_service="generator",
                    target_instance="gen-0", issuer="operator")
    await bus.publish(bus.subjects.control_action("generator", "gen-0", "drain"), ahead.encode(), msg_id=ahead.msg_id)
    c = controller(bus, life, tmp_path)
    async with running(c.workers(), life):
        await heartbeats(bus)
        await eventually(lambda: any(isinstance(ctl.decision, Admit) for _, ctl in decisions(bus)))
    ours = [(s, ctl) for s, ctl in decisions(bus) if ctl.issuer == "controller-0"]
    assert {ctl.action for _, ctl in ours} >= {"admit", "assign_pools"}
    for subject, ctl in ours:
        assert subject == bus.subjects.control_action("generator", ctl.target_instance, ctl.action)
        assert ctl.seq > ahead.seq  # the generator applies it: it sorts after the drain it saw
    ids = {s.msg_id for s in bus._streams["CONTROL"]}
    assert {ctl.msg_id for _, ctl in ours} <= ids


async def test_bad_requests_are_dead_lettered_with_the_reason_and_the_controller_keeps_going(tmp_path):
    bus, life = MemoryBus(RUN), Lifecycle(grace=1.0)
    c = controller(bus, life, tmp_path)
    mix_subject = bus.subjects.control_action("controller", "all", "set_mix")
    async with running(c.workers(), life):
        await bus.publish(mix_subject, b"\x93not a control", msg_id="garbage")
        wrong = Control(seq=1, decision=Admit(boot="x", grant_total=3), target_service="controller")
        await bus.publish(mix_subject, wrong.encode(), msg_id="wrong-kind")
        unknown = Control(seq=2, decision=SetMix(mix={"zz": 1.0}), target_service="controller")
        await bus.publish(mix_subject, unknown.encode(), msg_id="unknown-pool")
        # Not the controller's to judge: the generators dead-letter what arrives on theirs.
        await bus.publish(bus.subjects.control_action("generator", "gen-0", "admit"), b"junk", msg_id="gen-junk")
        await eventually(lambda: len(bus.dead_letters) == 3)
        good = Control(seq=3, decision=SetMix(mix={"a": 1.0, "b": 3.0}), target_service="controller",
                       reason="more of b", issuer="operator")
        await bus.publish(mix_subject, good.encode(), msg_id=good.msg_id)
        await eventually(lambda: c.planner.target_mix == {"a": 0.25, "b": 0.75})
        assert c.planner.clock.last >= 3
    bad = sorted(d.error.split(":")[0] for d in bus.dead_letters if d.reason == "bad_control")
    assert bad == ["MixError", "SchemaError"]
    misplaced = next(d for d in bus.dead_letters if d.reason == "misplaced_control")
    assert "not for the controller" in misplaced.error and Control.decode(misplaced.data) == wrong
    assert all(d.origin_subject == mix_subject for d in bus.dead_letters)


async def test_held_out_rounds_are_scheduled_recorded_and_pinned_by_weight_broadcast(tmp_path):
    bus, life = MemoryBus(RUN), Lifecycle(grace=1.0)
    held_out = [Task(run=RUN, task_id=f"add-{i}", pool="eval", env="addition", prompt=f"{i}+1=", answer=str(i + 1),
                     eval=True) for i in range(3)]
    c = controller(bus, life, tmp_path, EvalSchedule(held_out, every=2))
    b = BroadcastService(c.run_cfg, BroadcastSettings(keep_eval_versions=2), bus=bus, life=life,
                         broadcaster=Broadcaster(transport=None, cfg=BroadcastSettings(keep_eval_versions=2)))  # type: ignore[arg-type]
    async with running((*c.workers(), b.watch_evaluations), life):
        await heartbeats(bus, version=0)
        await eventually(lambda: list(b.b.eval_pins) == [0])
        await heartbeats(bus, version=2, seq=2)
        await eventually(lambda: list(b.b.eval_pins) == [0, 2])
        # What does not belong on the evaluate subject is refused there; the pins stay.
        evaluate = bus.subjects.control_action("generator", "all", "evaluate")
        stray = Control(seq=int(time.time() * 1e6), decision=RunState(state="pause"), target_service="generator")
        await bus.publish(evaluate, stray.encode(), msg_id="stray")
        await bus.publish(evaluate, b"\xc1", msg_id="junk")
        await eventually(lambda: len(bus.dead_letters) == 2)
        assert list(b.b.eval_pins) == [0, 2]
    rounds = [ctl for _, ctl in decisions(bus) if isinstance(ctl.decision, Evaluate)]
    assert [r.decision for r in rounds] == [Evaluate(version=0, tasks=3), Evaluate(version=2, tasks=3)]
    assert rounds[0].reason == "every 2 versions"
    tasks = [Task.decode(d) for s, d in bus.messages("TASKS")]
    assert [t.task_id for t in tasks][:3] == ["eval.v0.add-0", "eval.v0.add-1", "eval.v0.add-2"]
    assert {t.metadata["eval_version"] for t in tasks} == {0, 2}
    assert sorted(d.reason for d in bus.dead_letters) == ["bad_control", "misplaced_control"]


async def test_heartbeats_the_controller_cannot_address_are_refused_and_it_keeps_deciding(tmp_path):
    bus, life = MemoryBus(RUN), Lifecycle(grace=1.0)
    c = controller(bus, life, tmp_path)
    G = GeneratorKeys
    async with running(c.workers(), life):
        # Claims an instance name that is no subject token: a decision for it could not be published.
        odd = Heartbeat(service="generator", instance="gen 9", seq=1, ts=time.time(), info={G.INFO_BOOT: "z"})
        await bus.publish(bus.subjects.metrics("generator", "gen-9"), odd.encode(), msg_id="odd")
        # Names no boot: there is nothing to address a grant to (an Admit needs one).
        bootless = Heartbeat(service="generator", instance="gen-8", seq=1, ts=time.time(),
                             metrics={G.GROUPS_STARTED: 0, G.GROUPS_PUBLISHED: 0}, info={G.INFO_POOLS: ["a"]})
        await bus.publish(bus.subjects.metrics("generator", "gen-8"), bootless.encode(), msg_id="bootless")
        await eventually(lambda: len(bus.dead_letters) == 1)
        await heartbeats(bus)
        await eventually(lambda: any(isinstance(ctl.decision, Admit) for _, ctl in decisions(bus)))
    assert bus.dead_letters[0].reason == "misplaced_heartbeat" and "gen 9" in bus.dead_letters[0].error
    admitted = {ctl.target_instance for _, ctl in decisions(bus) if isinstance(ctl.decision, Admit)}
    assert admitted == {"gen-0"}
