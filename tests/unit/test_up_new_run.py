"""``rlbus up`` on a run folder that already holds a NATS store: decisions of the earlier run that
CONTROL still holds (a pause at its end, an operator's pause or drain) do not hold the new run's
generators, which join and read the last decision of every kind."""

from __future__ import annotations

import time

from rlbus.schemas import Control, RunState
from rlbus.services.commands.control import new_run
from rlbus.services.generator.settings import GeneratorSettings
from tests.unit.test_controller_faults_loop import GEN, Loop, eventually


async def test_a_new_run_is_not_held_by_the_pause_and_drain_an_earlier_run_left_on_control(tmp_path) -> None:
    async with Loop(tmp_path) as loop:
        at = time.time() - 3600
        for i, (target, state) in enumerate([(GEN, "pause"), ("all", "drain"), ("all", "pause")]):
            ctl = Control(seq=int(at * 1e6) + i, decision=RunState(state=state), target_service="generator",  # type: ignore[arg-type]
                          target_instance=target, reason="the operator, last run", issued_at=at, issuer="operator")
            await loop.bus.publish(loop.s.control_action("generator", target, state), ctl.encode(), msg_id=ctl.msg_id)
        resume = await new_run(loop.bus, [GEN])
        assert resume.target_instance == "all" and resume.issuer == "rlbus-up"
        loop.gen_cfg = GeneratorSettings(instance=GEN, admission=False, min_batch_groups=1, batch_wait_s=0.0)
        loop.start_generator()
        await loop.publish_tasks(8)
        await eventually(lambda: loop.published() == 8, what="the new run's generator samples every task")
        assert loop.gen_state() == "running"
