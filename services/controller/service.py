"""controller service — keeps trainer consumption matched to effective generator production.

consumes:  rl.<run>.metrics.>                       (Heartbeat) every service's liveness and counters
           rl.<run>.control.controller.<instance|all>.set_mix  (Control) a new target mix between pools
           consumer state of TASKS (per-pool backlog, held, redelivered) and SCORED (trainer pending)
produces:  rl.<run>.control.generator.<instance>.<action>  (Control) admit | assign_pools | concurrency |
             pause | resume | drain, each with its inputs and reason (the audit trail)
           rl.<run>.control.generator.all.evaluate   (Control) the record of each scheduled evaluation
           rl.<run>.tasks.<eval_pool>                (Task eval=True) held-out set at versions 0, k, 2k…
           rl.<run>.metrics.controller.<instance>    (Heartbeat) its measurements: C, P, E, kept and usable
             fractions overall and per pool, queue depths, the admission window, the target mix
waits for: trainer and generator heartbeats
The decisions are made in ``planner.py`` from ``state.py``'s measurements with the pure law in
``law.py`` and ``balance.py`` (the simulator in ``bench/controller_sim.py`` runs the same law); this
module is only I/O around them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from bus.protocol import Bus, BusError
from bus.subjects import Subjects
from observability.logging import get_logger
from schemas import Control, Heartbeat, SchemaError, Task
from services.controller.law import eval_due
from services.controller.planner import MixError, Planner
from services.controller.settings import ControllerSettings
from services.controller.state import queue_state
from services.runtime.config import RunSettings
from services.runtime.heartbeat import Beat
from services.runtime.lifecycle import Lifecycle, run_until_stopped
from services.runtime.taskfile import read_task_file

log = get_logger()

QUEUE_POLL_S = 1.0  # consumer state is a server round trip per stream: read it about once a second


async def run(run_cfg: RunSettings, cfg: ControllerSettings, *, bus: Bus, life: Lifecycle) -> None:
    subjects = Subjects(run_cfg.run)
    train_pools = [p for p in run_cfg.pools if p != run_cfg.eval_pool]
    planner = Planner(cfg, train_pools, run_cfg.batch_groups, run_cfg.max_staleness)
    beat = Beat(bus, subjects, "controller", cfg.instance)
    beat.extra = planner.metrics
    eval_tasks: list[Task] = []
    if cfg.eval_tasks and cfg.eval_every > 0:
        eval_tasks, errors = read_task_file(cfg.eval_tasks, run=run_cfg.run, pool=run_cfg.eval_pool, group_size=1,
                                            eval=True)
        if errors:
            log.warning("eval_tasks_invalid_lines", errors=[str(e) for e in errors[:5]], count=len(errors))
    last_eval = -1

    async def watch_metrics() -> None:
        async for d in bus.watch(subjects.all_of("metrics"), deliver="new"):
            try:
                planner.state.observe(Heartbeat.decode(d.msg))
            except SchemaError as exc:
                await bus.dead_letter(d.subject, d.msg, reason="schema_error", error=f"SchemaError: {exc}")

    async def watch_requests() -> None:
        async def one(subject: str) -> None:
            async for d in bus.watch(subject, deliver="last_per_subject"):
                try:
                    note = planner.set_mix(Control.decode(d.msg))
                except (SchemaError, MixError) as exc:
                    log.error("control_request_refused", subject=d.subject, error=str(exc))
                    await bus.dead_letter(d.subject, d.msg, reason="bad_control", error=f"{type(exc).__name__}: {exc}")
                    continue
                if note:
                    log.info("target_mix_changed", note=note)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(one(subjects.control_actions("controller", cfg.instance)))
            tg.create_task(one(subjects.control_actions("controller", "all")))

    async def watch_queues() -> None:
        while True:
            try:
                planner.state.queues = queue_state(await bus.streams(), subjects, train_pools, time.time())
            except BusError as exc:  # a restarting server: the last reading stays, marked by its time
                log.warning("queue_state_unavailable", error=str(exc))
            if await life.sleep(QUEUE_POLL_S):
                return

    async def publish_eval(version: int, why: str) -> None:
        items = []
        for t in eval_tasks:
            task = replace(t, task_id=f"eval.v{version}.{t.task_id}", metadata={**t.metadata, "eval_version": version})
            items.append((subjects.tasks(run_cfg.eval_pool), task.encode(), task.msg_id))
        await bus.publish_many(items)
        d = planner.evaluate(version, len(items), why, time.time())
        await bus.publish(subjects.control_action(d.service, d.instance, d.control.action), d.control.encode(),
                          msg_id=f"ctl.{d.control.seq}")
        log.info("eval_scheduled", version=version, tasks=len(items))

    async def decide() -> None:
        nonlocal last_eval
        while not await life.sleep(cfg.period):
            for d in planner.step(time.time()):
                await bus.publish(subjects.control_action(d.service, d.instance, d.control.action),
                                  d.control.encode(), msg_id=f"ctl.{d.control.seq}")
                if d.control.action != "admit":
                    log.info("decision", action=d.control.action, instance=d.instance, params=d.control.params,
                             reason=d.control.reason)
            trainer = planner.state.trainer
            beat.version = trainer.version
            final = trainer.done and trainer.version > last_eval
            if eval_tasks and (final or eval_due(trainer.version, last_eval, cfg.eval_every)):
                last_eval = trainer.version
                await publish_eval(last_eval, "final version" if final else f"every {cfg.eval_every} versions")

    beat.state = "running"
    log.info("controller_ready", target_mix=planner.target_mix, pools=train_pools)
    await run_until_stopped(life, lambda: beat.loop(life), watch_metrics, watch_requests, watch_queues, decide)
