"""The stall reported after an environment restart: 915 of 1,200 tasks reached the trainer, then
nothing, every service up and no error logged.

The generator naks a batch whose resets fail ("no responders") with a short delay and goes straight
on to the next tasks, so during an outage it cycles through the whole backlog, and every cycle
counts as a delivery: after ``TASK_MAX_DELIVER`` of them a task is dead-lettered (a warning line,
not an error).  An outage longer than ``TASK_MAX_DELIVER x ENV_RETRY_S`` (5 x 2 s: a kill -9 and a
restart of the environment service) thereby turns the queued task set into dead letters; the
tasks still in flight get through, the trainer takes a few more steps and then waits for groups
that no task will ever produce.  The fix: the generator holds a batch whose resets
fail and retries the same reset with backoff (``BatchDriver._request_resets``), so an outage costs
time, not deliveries; and the controller reports a stall with its cause (``no_work_queued`` /
``environment_not_answering``, see tests/unit/test_controller_faults.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlbus.services.generator.batch import BatchDriver
from rlbus.services.generator.intake import TASK_MAX_DELIVER
from rlbus.services.generator.settings import GeneratorSettings
from tests.unit.test_controller_faults_loop import GEN, Loop, eventually


async def test_an_environment_outage_does_not_use_up_the_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Needed in services/generator/batch.py (``BatchDriver._reset_env``): when the request fails with
    a ``BusError`` (no responders, timeout), keep the tasks held (the puller heartbeats them with
    in_progress, so they stay this generator's and their delivery count does not move), wait with a
    capped exponential backoff starting at ``ENV_RETRY_S``, and retry the same reset; only past a
    deadline (several task ack waits, or a stop) nak them.  The intake must not take new tasks
    meanwhile (the driver awaits the retry), so an outage costs time, not tasks."""
    retry = 0.2
    monkeypatch.setattr(BatchDriver, "ENV_RETRY_S", retry)
    async with Loop(tmp_path, env=False) as loop:
        loop.gen_cfg = GeneratorSettings(instance=GEN, admission=False, min_batch_groups=1, batch_wait_s=0.0)
        loop.start_generator()
        await loop.publish_tasks(8)
        # The environment is down (killed, restarting) for longer than max_deliver retries last.
        await asyncio.sleep(3 * TASK_MAX_DELIVER * retry)
        loop.env.start()
        await eventually(lambda: loop.published() + len(loop.bus.dead_letters) >= 8, timeout=30.0,
                         what="every task settled")
        assert [d.reason for d in loop.bus.dead_letters] == [] and loop.published() == 8


async def test_the_stall_after_an_environment_outage_is_reported_with_its_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported scenario as the controller sees it: the environment goes away while tasks are
    queued.  The controller names the environment while it is away (never silent), and once it is
    back the held work goes through and the stall is cleared."""
    retry = 0.2
    monkeypatch.setattr(BatchDriver, "ENV_RETRY_S", retry)
    async with Loop(tmp_path, stall_after=1.0, silent_after=2.0) as loop:
        loop.trainer.dropped = 100  # a wide admission window: the generator may take what is queued
        loop.start_generator()
        loop.start_controller()
        await loop.publish_tasks(4)
        await eventually(lambda: loop.published() >= 4, what="groups published")

        def causes() -> list[str]:
            return [c.decision.cause for s, c in loop.decisions()
                    if s == loop.s.control_action("controller", "controller-0", "stall")]

        loop.env.stop()
        await loop.publish_tasks(20, prefix="later")
        await eventually(lambda: "environment_not_answering" in causes(), timeout=30.0, what="the environment named")
        loop.env.start()
        # The generator held its batch through the outage: nothing was dead-lettered, the run goes
        # on, and the controller clears the stall (a record with an empty cause).
        await eventually(lambda: loop.published() >= 24, timeout=30.0, what="the later tasks published")
        await eventually(lambda: causes()[-1] == "", timeout=30.0, what="the stall cleared")
        assert loop.bus.dead_letters == []
