"""controller service — admission for bounded staleness, held-out evaluation scheduling.

consumes:  rl.<run>.metrics.>        (Heartbeat)  every service's liveness and counters
produces:  rl.<run>.control.generator.<instance>  (Control action='admit', cumulative grant)
           rl.<run>.tasks.<eval_pool>             (Task eval=True) held-out set at versions 0, k, 2k…
           rl.<run>.metrics.controller.<instance> (its own decisions as metrics)
waits for: trainer and generator heartbeats
The control law lives in ``law.py`` (pure, unit-tested, reused by the simulator); this module is
only I/O around it.  Every decision is published with its inputs and reason (audit trail).
"""

from __future__ import annotations

import time
from dataclasses import replace

from bus.protocol import Bus
from bus.subjects import Subjects
from observability.logging import get_logger
from schemas import Control, Heartbeat, SchemaError, Task
from services.controller.law import GeneratorView, TrainerView, eval_due, plan_balanced
from services.controller.settings import ControllerSettings
from services.runtime.config import RunSettings
from services.runtime.heartbeat import Beat
from services.runtime.lifecycle import Lifecycle, run_until_stopped
from services.runtime.taskfile import read_task_file

log = get_logger()


class ControllerState:
    def __init__(self) -> None:
        self.generators: dict[tuple[str, str], GeneratorView] = {}
        self.trainer = TrainerView()
        self.heartbeats: dict[tuple[str, str], Heartbeat] = {}
        self.kept_fraction = float("nan")

    def observe(self, hb: Heartbeat) -> None:
        self.heartbeats[(hb.service, hb.instance)] = hb
        now = time.time()
        if hb.service == "generator":
            boot = str(hb.info.get("boot", ""))
            g = self.generators.setdefault((hb.instance, boot), GeneratorView(hb.instance, boot))
            g.started = int(hb.metrics.get("generator/groups_started", g.started))
            g.published = int(hb.metrics.get("generator/groups_published", g.published))
            g.rate = float(hb.metrics.get("generator/groups_per_s", g.rate))
            if hb.version >= 0:
                g.weights_version = hb.version
            g.last_seen = 0.0 if hb.state == "stopped" else now
        elif hb.service == "trainer":
            self.trainer.version = int(hb.metrics.get("trainer/version", self.trainer.version))
            self.trainer.dropped_groups = int(hb.metrics.get("trainer/groups_dropped_total", self.trainer.dropped_groups))
            self.trainer.trained_groups = int(hb.metrics.get("trainer/groups_trained_total", self.trainer.trained_groups))
            self.trainer.last_seen = now
            self.trainer.done = hb.state == "done"
            self.trainer.pending_groups = int(hb.metrics.get("trainer/pending_groups", 0))
            kept = hb.metrics.get("trainer/groups_train", 0.0)
            lost = hb.metrics.get("trainer/groups_filtered", 0.0) + hb.metrics.get("trainer/groups_invalid", 0.0)
            # Share of groups that survive filtering; stale drops are excluded so over-sampling
            # cannot feed on its own surplus.  No measurement yet: no over-sampling.
            self.kept_fraction = kept / (kept + lost) if kept + lost >= 32 else float("nan")


async def run(run_cfg: RunSettings, cfg: ControllerSettings, *, bus: Bus, life: Lifecycle) -> None:
    subjects = Subjects(run_cfg.run)
    state = ControllerState()
    beat = Beat(bus, subjects, "controller", cfg.instance)
    seq = int(time.time() * 1000)  # monotonic across restarts: later decisions sort later
    sent: dict[tuple[str, str], tuple[tuple[int, int], float]] = {}
    eval_tasks: list[Task] = []
    if cfg.eval_tasks and cfg.eval_every > 0:
        eval_tasks, errors = read_task_file(cfg.eval_tasks, run=run_cfg.run, pool=run_cfg.eval_pool, group_size=1,
                                            eval=True)
        if errors:
            log.warning("eval_tasks_invalid_lines", errors=[str(e) for e in errors[:5]], count=len(errors))
    last_eval = -1

    async def watch() -> None:
        async for d in bus.watch(subjects.all_of("metrics"), deliver="new"):
            try:
                state.observe(Heartbeat.decode(d.msg))
            except SchemaError as exc:
                await bus.dead_letter(d.subject, d.msg, reason="schema_error", error=f"SchemaError: {exc}")

    async def publish_eval(version: int) -> None:
        items = []
        for t in eval_tasks:
            task = replace(t, task_id=f"eval.v{version}.{t.task_id}", metadata={**t.metadata, "eval_version": version})
            items.append((subjects.tasks(run_cfg.eval_pool), task.encode(), f"task.{task.task_id}"))
        await bus.publish_many(items)
        log.info("eval_scheduled", version=version, tasks=len(items))

    async def decide() -> None:
        nonlocal seq, last_eval
        while not await life.sleep(cfg.period):
            now = time.time()
            plan = plan_balanced(list(state.generators.values()), state.trainer, batch_groups=run_cfg.batch_groups,
                                 max_staleness=run_cfg.max_staleness, now=now, silent_after=cfg.silent_after,
                                 max_outstanding=cfg.max_outstanding, kept_fraction=state.kept_fraction)
            # Groups admitted now are trained up to max_staleness versions from now, so they must
            # start from the trainer's current weights: older ones would arrive stale and be
            # refused.  The generator waits for the new version (a fetch, ~0.1 s here) instead.
            min_version = state.trainer.version
            for (instance, boot), grant in plan.grants.items():
                g = state.generators[(instance, boot)]
                prev = sent.get((instance, boot))
                if not g.alive or (prev and prev[0] == (grant, min_version) and now - prev[1] < cfg.refresh):
                    continue
                seq += 1
                ctl = Control(seq=seq, action="admit", target_service="generator", target_instance=instance,
                              params={"boot": boot, "grant_total": grant, "min_version": min_version},
                              reason=plan.reason,
                              inputs={"trainer_version": state.trainer.version, "allowed_total": plan.allowed_total,
                                      "oversample": plan.oversample, "kept_fraction": state.kept_fraction,
                                      "started_total": plan.started_total, "dropped": state.trainer.dropped_groups},
                              issued_at=now)
                await bus.publish(subjects.control("generator", instance), ctl.encode(), msg_id=f"ctl.{seq}")
                sent[(instance, boot)] = ((grant, min_version), now)
            beat.metrics.update({"controller/allowed_total": plan.allowed_total, "controller/oversample": plan.oversample,
                                 "controller/started_total": plan.started_total,
                                 "controller/live_generators": sum(g.alive for g in state.generators.values()),
                                 "controller/trainer_version": state.trainer.version})
            beat.version = state.trainer.version
            final = state.trainer.done and state.trainer.version > last_eval
            if eval_tasks and (final or eval_due(state.trainer.version, last_eval, cfg.eval_every)):
                last_eval = state.trainer.version
                await publish_eval(last_eval)

    beat.state = "running"
    await run_until_stopped(life, lambda: beat.loop(life), watch, decide)
