"""controller service — keeps trainer consumption matched to effective generator production.

consumes:  rl.<run>.metrics.>                       (Heartbeat) every service's liveness and counters
           rl.<run>.control.>                       (Control) every decision of the run, any issuer: the last
             of each subject at start, then each new one; its ``seq`` orders this controller's next
             decisions after it (``DecisionClock``)
           rl.<run>.control.controller.<instance|all>.set_mix  (Control ``SetMix``) a new target mix between pools
           consumer state of TASKS (per-pool backlog, held, redelivered) and SCORED (trainer pending)
           rl.<run>.scored.<eval_pool>               (ScoredGroup) held-out results, every one from the stream's start:
             each complete round is one held-out accuracy reading for the divergence alarm
produces:  rl.<run>.control.generator.<instance>.<action>  (Control) ``Admit`` | ``AssignPools`` | ``Concurrency``
             | ``RunState`` (pause, resume, drain), each with its inputs and reason (the audit trail)
           rl.<run>.control.generator.all.evaluate   (Control ``Evaluate``) the record of each scheduled evaluation
           rl.<run>.tasks.<eval_pool>                (Task eval=True) held-out set at versions 0, k, 2k…
           rl.<run>.metrics.controller.<instance>    (Heartbeat) its measurements: C, P, E, kept and usable
             fractions overall and per pool, queue depths, the admission window, the target mix
           rl.<run>.dead.control                     a request to this controller that does not decode, is not
             a ``SetMix`` on its own subject, or names a mix it cannot use (with the reason)
           rl.<run>.control.controller.<instance>.stall  (Control ``Stall``) no progress for ``stall_after`` seconds
             while work waits, with the likely cause (``stall.py``); an empty cause once progress resumes
           rl.<run>.control.controller.<instance>.divergence  (Control ``Divergence``) training reward rising while
             held-out accuracy falls over ``[controller.divergence] window`` versions (``divergence.py``), and
             its end (``firing`` False)
waits for: trainer and generator heartbeats; the stored decisions of the run before its first decision
The decisions are made in ``planner.py`` from ``state.py``'s measurements with the pure law in
``law.py`` and ``balance.py`` (the simulator in ``bench/controller_sim.py`` runs the same law); this
module is only I/O around them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from rlbus.bus.protocol import Bus, BusError, Delivery
from rlbus.bus.subjects import SubjectError, Subjects
from rlbus.observability.logging import get_logger
from rlbus.observability.tracing import task_traces
from rlbus.schemas import Admit, Control, Divergence, Heartbeat, SchemaError, ScoredGroup, SetMix, Stall, Task
from rlbus.services.controller.divergence import DivergenceMonitor, HeldOutRounds
from rlbus.services.controller.law import TrainerView, eval_due
from rlbus.services.controller.planner import MixError, Planner
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.controller.stall import StallWatch
from rlbus.services.controller.state import queue_state
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped
from rlbus.services.runtime.taskfile import read_task_file

log = get_logger()

QUEUE_POLL_S = 1.0  # consumer state is a server round trip per stream: read it about once a second
# The stored decisions of the run arrive back to back when the CONTROL watch starts; the first
# decision waits until that burst has been quiet this long (at most HISTORY_LIMIT_S), so its seq
# sorts after them even when an operator's clock runs ahead of this one.
HISTORY_QUIET_S = 0.5
HISTORY_LIMIT_S = 5.0
# CONTROL holds decisions but none has arrived yet (a slow server creating the watch): quiet means
# nothing then, so the first decision waits for the first of them, this long at most.
HISTORY_FIRST_LIMIT_S = 30.0


class ControlRefused(Exception):
    """A Control on a controller subject that it does not belong on (not a ``SetMix``, or its target
    and action name another subject)."""


def check_subject(ctl: Control, subject: str, subjects: Subjects) -> None:
    """Raise ``ControlRefused`` unless ``ctl`` is a request to a controller published on its own
    subject (``subjects.control_action(service, instance, control.action)``)."""
    if not isinstance(ctl.decision, SetMix):
        raise ControlRefused(f"a {ctl.action!r} decision is not for the controller (it came on {subject!r}); "
                             "the controller takes 'set_mix' requests only")
    try:
        expected = subjects.control_action(ctl.target_service, ctl.target_instance, ctl.action)
    except SubjectError as exc:
        raise ControlRefused(f"the decision's target does not name a subject: {exc}") from None
    if subject != expected:
        raise ControlRefused(f"a decision for {ctl.target_service}/{ctl.target_instance} ({ctl.action}) came on "
                             f"{subject!r}; publish it on {expected!r}")


class EvalSchedule:
    """Held-out rounds: the task file, read once, scheduled at versions 0, k, 2k… and at the final one."""

    def __init__(self, tasks: list[Task], every: int) -> None:
        self.tasks = tasks
        self.every = every
        self.last_version = -1  # the version of the last round scheduled

    @classmethod
    def from_settings(cls, run_cfg: RunSettings, cfg: ControllerSettings) -> EvalSchedule:
        tasks: list[Task] = []
        if cfg.eval_tasks and cfg.eval_every > 0:
            tasks, errors = read_task_file(cfg.eval_tasks, run=run_cfg.run, pool=run_cfg.eval_pool, group_size=1,
                                           eval=True)
            if errors:
                log.warning("eval_tasks_invalid_lines", errors=[str(e) for e in errors[:5]], count=len(errors))
        return cls(tasks, cfg.eval_every)

    def due(self, trainer: TrainerView) -> tuple[int, str] | None:
        """(version, why) of the round to schedule now, or None."""
        if not self.tasks:
            return None
        if trainer.done and trainer.version > self.last_version:
            return trainer.version, "final version"
        if eval_due(trainer.version, self.last_version, self.every):
            return trainer.version, f"every {self.every} versions"
        return None

    def round(self, version: int) -> list[Task]:
        """The held-out tasks of the round at ``version`` (ids and metadata carry the version)."""
        self.last_version = version
        return [replace(t, task_id=f"eval.v{version}.{t.task_id}", metadata={**t.metadata, "eval_version": version})
                for t in self.tasks]


class ControlWatch:
    """The run's CONTROL stream as this controller reads it: every decision's seq goes to the
    planner's clock (so its own next decisions sort after it); a request addressed to this controller
    is applied, or dead-lettered with the reason."""

    def __init__(self, bus: Bus, subjects: Subjects, planner: Planner, instance: str,
                 divergence: DivergenceMonitor | None = None) -> None:
        self.bus = bus
        self.subjects = subjects
        self.planner = planner
        self.divergence = divergence  # told this controller's last divergence record, read back after a restart
        # Requests for this controller arrive on these prefixes; everything else is only observed.
        self.instance = instance
        self.requests_on = (subjects.control("controller", instance) + ".", subjects.control("controller", "all") + ".")
        self.seen_at = time.monotonic()  # when the watch last delivered (or started)
        self.delivered = 0  # decisions the watch delivered

    async def watch(self) -> None:
        self.seen_at = time.monotonic()
        async for d in self.bus.watch(self.subjects.all_of("control"), deliver="last_per_subject"):
            self.seen_at = time.monotonic()
            self.delivered += 1
            await self.on_delivery(d)

    async def history_read(self, life: Lifecycle, *, stored: int = 0) -> None:
        """Return once the stored decisions have arrived: the watch has been quiet ``HISTORY_QUIET_S``
        (or ``HISTORY_LIMIT_S`` passed) after delivering at least one when CONTROL holds ``stored`` > 0
        (waiting up to ``HISTORY_FIRST_LIMIT_S`` for it): a restarted controller whose watch is slow to
        start would otherwise take decisions whose seq sorts before its predecessor's, and the
        generators would ignore them."""
        start = time.monotonic()
        while time.monotonic() - start < HISTORY_FIRST_LIMIT_S:
            waiting_first = stored > 0 and self.delivered == 0
            if not waiting_first and (time.monotonic() - self.seen_at >= HISTORY_QUIET_S
                                      or time.monotonic() - start >= HISTORY_LIMIT_S):
                return
            if await life.sleep(HISTORY_QUIET_S / 5):
                return
        log.warning("control_history_late", stored=stored, waited_s=HISTORY_FIRST_LIMIT_S,
                    hint="the CONTROL watch delivered nothing; deciding now (seqs from this clock)")

    async def on_delivery(self, d: Delivery[bytes]) -> None:
        mine = d.subject.startswith(self.requests_on)
        try:
            ctl = Control.decode(d.msg)
        except SchemaError as exc:
            if mine:  # the other subjects' receivers dead-letter their own
                await self._refuse(d, "bad_control", f"SchemaError: {exc}")
            return
        self.planner.observe(ctl)
        own = mine and ctl.issuer in (self.instance, "")
        if own and isinstance(ctl.decision, Divergence) and self.divergence is not None:
            self.divergence.restore(ctl.decision)
        if not mine or (own and isinstance(ctl.decision, (Stall, Divergence))):
            return  # a stall or divergence record is this controller's own report, read back
        try:
            check_subject(ctl, d.subject, self.subjects)
        except ControlRefused as exc:
            await self._refuse(d, "misplaced_control", str(exc))
            return
        try:
            note = self.planner.set_mix(ctl)
        except MixError as exc:
            await self._refuse(d, "bad_control", f"MixError: {exc}")
            return
        if note:
            log.info("target_mix_changed", note=note, seq=ctl.seq, issuer=ctl.issuer)

    async def _refuse(self, d: Delivery[bytes], reason: str, error: str) -> None:
        log.error("control_request_refused", subject=d.subject, reason=reason, error=error)
        await self.bus.dead_letter(d.subject, d.msg, reason=reason, error=error)


class Controller:
    """The controller's moving parts: the planner (what it knows and decides), its heartbeat, the
    held-out schedule, and the watch of the run's decisions that keeps its ``seq`` after theirs."""

    def __init__(self, run_cfg: RunSettings, cfg: ControllerSettings, *, bus: Bus, life: Lifecycle,
                 evals: EvalSchedule) -> None:
        self.run_cfg = run_cfg
        self.cfg = cfg
        self.bus = bus
        self.life = life
        self.subjects = Subjects(run_cfg.run)
        self.train_pools = [p for p in run_cfg.pools if p != run_cfg.eval_pool]
        self.planner = Planner(cfg, self.train_pools, run_cfg.batch_groups, run_cfg.max_staleness)
        self.evals = evals
        self.beat = Beat(bus, self.subjects, "controller", cfg.instance)
        self.beat.extra = self.metrics
        self.divergence = DivergenceMonitor(cfg.divergence)
        self.heldout = HeldOutRounds(len(evals.tasks))
        self.control = ControlWatch(bus, self.subjects, self.planner, cfg.instance, self.divergence)
        self.stalls = StallWatch(cfg.stall_after, cfg.silent_after)
        self.invalid_decision = ""  # the last decision the planner could not build (logged once)

    def metrics(self) -> dict[str, float]:
        """Its heartbeat: the planner's measurements, how long progress has stalled (0: it has not),
        the divergence alarm and its trends, and how many heartbeat values it had to skip."""
        return {**self.planner.metrics(), **self.stalls.metrics(time.time()), **self.divergence.metrics(),
                "controller/heartbeat_values_skipped": self.planner.state.readings.skipped}

    def workers(self) -> tuple[Callable[[], Awaitable[None]], ...]:
        """Every loop the service runs, for ``run_until_stopped``."""
        held_out = (self.watch_heldout,) if self.evals.tasks else ()
        return (lambda: self.beat.loop(self.life), self.watch_metrics, self.control.watch, self.watch_queues,
                *held_out, self.decide)

    # --- inputs ------------------------------------------------------------------------------
    async def watch_metrics(self) -> None:
        async for d in self.bus.watch(self.subjects.all_of("metrics"), deliver="new"):
            try:
                hb = Heartbeat.decode(d.msg)
                # Decisions are addressed by the instance a heartbeat names: it must be the one its
                # subject names (a name that is no subject token could not be addressed at all).
                if d.subject != self.subjects.metrics(hb.service, hb.instance):
                    raise SubjectError(f"a heartbeat of {hb.service}/{hb.instance} came on {d.subject!r}; "
                                       "publish it on subjects.metrics(service, instance)")
            except SchemaError as exc:
                await self.bus.dead_letter(d.subject, d.msg, reason="schema_error", error=f"SchemaError: {exc}")
                continue
            except SubjectError as exc:
                await self.bus.dead_letter(d.subject, d.msg, reason="misplaced_heartbeat", error=str(exc))
                continue
            try:
                self.planner.state.observe(hb)
                if hb.service == "trainer":
                    self.divergence.observe_trainer(hb)
            except Exception as exc:  # noqa: BLE001 - a reading bug must cost this heartbeat, not the controller
                log.exception("heartbeat_unusable", subject=d.subject, error=repr(exc))
                await self.bus.dead_letter(d.subject, d.msg, reason="heartbeat_unusable", error=repr(exc))

    async def watch_heldout(self) -> None:
        """Held-out results from the stream's start, so a restarted controller judges on the rounds
        already scored (the window needs several)."""
        subject = self.subjects.scored(self.run_cfg.eval_pool)
        async for d in self.bus.watch(subject, deliver="all"):
            try:
                reading = self.heldout.add(ScoredGroup.decode(d.msg))
            except SchemaError:
                continue  # the trainer never takes the eval pool; what is unreadable here harms no reading
            if reading is not None:
                self.divergence.observe_heldout(reading)
                log.info("heldout_round", version=reading.version, accuracy=round(reading.accuracy, 4),
                         rollouts=reading.n)

    async def watch_queues(self) -> None:
        while True:
            try:
                self.planner.state.queues = queue_state(await self.bus.streams(), self.subjects, self.train_pools,
                                                        time.time())
            except BusError as exc:  # a restarting server: the last reading stays, marked by its time
                log.warning("queue_state_unavailable", error=str(exc))
            if await self.life.sleep(QUEUE_POLL_S):
                return

    # --- the decision loop ---------------------------------------------------------------------
    async def stored_decisions(self) -> int:
        """Messages CONTROL holds (0 when the server cannot say)."""
        try:
            return next((s.messages for s in await self.bus.streams() if s.name == self.subjects.stream("CONTROL")), 0)
        except BusError as exc:
            log.warning("control_history_unknown", error=str(exc))
            return 0

    async def decide(self) -> None:
        await self.control.history_read(self.life, stored=await self.stored_decisions())
        while not await self.life.sleep(self.cfg.period):
            for ctl in self.step():
                await self.publish(ctl)
                if not isinstance(ctl.decision, Admit):  # admissions are many; their record is CONTROL
                    log.info("decision", action=ctl.action, instance=ctl.target_instance,
                             decision=dataclasses.asdict(ctl.decision), reason=ctl.reason)
            trainer = self.planner.state.trainer
            self.beat.version = trainer.version
            due = self.evals.due(trainer)
            if due is not None:
                await self.publish_eval(*due)
            await self.watch_progress()
            await self.watch_divergence()

    async def watch_progress(self) -> None:
        """Report a stall (and its end) on CONTROL and in the log: never a silent one."""
        now = time.time()
        record = self.stalls.check(self.planner, now)
        if record is None:
            return
        inputs = self.stalls.evidence.inputs() if record.cause and self.stalls.evidence else {}
        await self.publish(self.planner.record(record, record.detail, inputs, now))
        if not record.cause:
            log.info("stall_cleared", detail=record.detail)
        elif record.cause == "no_work_queued" and not (self.stalls.evidence and self.stalls.evidence.dead):
            # The task set may simply be used up; with dead letters on DEAD, tasks were lost on the way.
            log.warning("stall", cause=record.cause, stalled_s=record.stalled_s, detail=record.detail)
        else:
            log.error("stall", cause=record.cause, stalled_s=record.stalled_s, detail=record.detail)

    async def watch_divergence(self) -> None:
        """Report the reward/held-out divergence alarm (and its end) on CONTROL and in the log."""
        record = self.divergence.check()
        if record is None:
            return
        t = self.divergence.trends
        inputs = {"window": self.cfg.divergence.window, "reward_readings": t.reward.n if t.reward else 0,
                  "reward_se": t.reward.se if t.reward else None, "heldout_se": t.heldout.se if t.heldout else None}
        await self.publish(self.planner.record(record, record.detail, inputs, time.time()))
        if record.firing:
            log.warning("reward_heldout_divergence", reward_trend=record.reward_trend,
                        heldout_trend=record.heldout_trend, versions=f"{record.from_version}..{record.to_version}",
                        detail=record.detail)
        else:
            log.info("divergence_cleared", reward_trend=record.reward_trend, heldout_trend=record.heldout_trend,
                     detail=record.detail)

    def step(self) -> list[Control]:
        try:
            return self.planner.step(time.time())
        except SchemaError as exc:
            # A decision that fails its own validation was taken on inputs no healthy service reports
            # (e.g. negative counters in a heartbeat): skip this period and keep deciding; log it once.
            if str(exc) != self.invalid_decision:
                self.invalid_decision = str(exc)
                log.error("decision_invalid", error=str(exc), fix="find the heartbeat that reports these inputs")
            return []

    async def publish(self, ctl: Control) -> None:
        await self.bus.publish(self.subjects.control_action(ctl.target_service, ctl.target_instance, ctl.action),
                               ctl.encode(), msg_id=ctl.msg_id)

    async def publish_eval(self, version: int, why: str) -> None:
        tasks = self.evals.round(version)
        pool = self.subjects.tasks(self.run_cfg.eval_pool)
        with task_traces(tasks) as traces:  # held-out tasks are traced like any task
            await self.bus.publish_many([(pool, t.encode(), t.msg_id) for t in tasks], item_headers=traces)
        await self.publish(self.planner.evaluate(version, len(tasks), why, time.time()))
        log.info("eval_scheduled", version=version, tasks=len(tasks))


async def run(run_cfg: RunSettings, cfg: ControllerSettings, *, bus: Bus, life: Lifecycle) -> None:
    controller = Controller(run_cfg, cfg, bus=bus, life=life, evals=EvalSchedule.from_settings(run_cfg, cfg))
    controller.beat.state = "running"
    log.info("controller_ready", target_mix=controller.planner.target_mix, pools=controller.train_pools)
    await run_until_stopped(life, *controller.workers())
