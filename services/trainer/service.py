"""trainer service — GRPO steps on scored groups, within the staleness bound, crash-safe.

consumes:  rl.<run>.scored.<pool>   (ScoredGroup)  durable 'trainer', explicit ack once two
                                                   checkpoints cover the step that used it
produces:  rl.<run>.uploads.<model>  (WeightManifest state=uploaded, UPLOADS)  msg id 'upload.<model>.v<N>'
           rl.<run>.metrics.trainer.<instance>  (Heartbeat) per step: loss, mismatch, staleness, idle,
                                                   group outcomes per pool and per generator
reads:     rl.<run>.weights.<model>  (last WeightManifest) once at start: with <checkpoints>/versions.json
           (every version handed out, uploads in flight included), the highest version ever used
waits for: a full batch of ``batch_groups`` informative, fresh groups
unblocked by: generators (via reward) producing within the controller's admission

A scored group passes through, in order:
  Intake (intake.py)        pulls it and offers it to the Assembler (batch.py): kept for a batch,
                            or dropped with a reason; pulls on while a step runs (prefetch)
  TrainerLoop (here)        takes a full batch, packs it, runs one step (TrainedPolicy, policy.py);
                            a step that refuses its input (LogprobInputError: what the intake
                            judge, judge.py, let through) refuses the groups at fault, makes no
                            version, and gives the others back for the next batch
  Uploader (policy/upload.py) snapshots the new version's weights, uploads them in the background,
                            one at a time, in version order
  Committer (commit.py)     records the group in the ledger; every ``checkpoint_every`` steps
                            checkpoints (fsync) and then acks what the checkpoint before it
                            covers (acks lag one checkpoint: a damaged newest one loses nothing)
  Telemetry (telemetry.py)  heartbeats the counters (counters.py) and the step's metrics
A crash redelivers what was not acked; the ledger of the checkpoint resumed from (the newest, or
the one before it if the newest is damaged) turns redeliveries of committed groups into acks, so
no group is trained twice in the surviving model.  Versions are a monotonic identity of weights: a resumed trainer continues after the highest version any trainer
of the run handed out or published (versions.py), so a number never names two different
sets of weights, and its restored model's version is recorded as a fork of the checkpoint's, so
samples of the versions lost with the crash are not taken for fresh ones.  A graceful stop
commits what was trained, verifies that checkpoint on disk before acking what it covers, and
naks what waited for a batch.
Under torchrun (``[trainer] distributed``) this is rank 0; the other ranks only follow its
steps and state gathers (distributed.py).  There rank 0 runs the step's input check on the whole
batch before any rank starts the step, so a refused batch is refused here as in one process and
no rank raises mid-step.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from opentelemetry.trace import Span

from rlbus.bus.protocol import Bus
from rlbus.bus.subjects import Subjects
from rlbus.observability import tracing
from rlbus.observability.logging import get_logger
from rlbus.schemas import SchemaError, ScoredGroup, WeightManifest
from rlbus.services.policy.logprobs import LogprobInputError
from rlbus.services.policy.upload import Uploader
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.runtime.weights import make_transport
from rlbus.services.trainer import checkpoint
from rlbus.services.trainer.batch import Assembler, GroupDecision
from rlbus.services.trainer.board import StepBoard
from rlbus.services.trainer.commit import Committer
from rlbus.services.trainer.counters import Counters
from rlbus.services.trainer.intake import Intake, consumer_spec
from rlbus.services.trainer.policy import TrainedPolicy
from rlbus.services.trainer.settings import TrainerSettings
from rlbus.services.trainer.step import PackedSeq, pack, step_refusals
from rlbus.services.trainer.telemetry import Telemetry
from rlbus.services.trainer.versions import VersionBook

log = get_logger()


async def run(run_cfg: RunSettings, cfg: TrainerSettings, *, bus: Bus, life: Lifecycle) -> None:
    policy = await TrainedPolicy.load(run_cfg, cfg)
    if policy is None:
        return  # a follower rank of a torchrun job, released by rank 0
    try:
        trainer = await TrainerLoop.start(run_cfg, cfg, policy, bus=bus, life=life)
        await trainer.run()
    finally:
        await policy.close()


async def highest_version_used(bus: Bus, subjects: Subjects, model_name: str, book: VersionBook) -> int:
    """The highest version number any trainer of this run may have used: handed out (the book is
    written before an upload starts, so it covers uploads still in flight to weight-broadcast) or
    published.  Not the newest message on the uploads subject: nothing has verified it yet, and a
    forged or broken upload (which weight-broadcast refuses) must not move the numbering."""
    used = book.highest
    raw = await bus.last(subjects.weights(model_name), wait=True)
    if raw is not None:
        try:
            used = max(used, WeightManifest.decode(raw).version)
        except SchemaError as exc:  # weight-broadcast's own record; the book still counts
            log.warning("unreadable_weight_manifest", subject=subjects.weights(model_name), error=str(exc))
    return used


def step_links(batch: list[GroupDecision]) -> list[tuple[dict[str, str] | None, dict[str, Any]]]:
    """A link per group: its scored message's trace context, with what the step made of it."""
    links = []
    for d in batch:
        trained = [s for s, m in zip(d.staleness, d.train_mask, strict=True) if m]
        links.append((getattr(d.handle, "headers", None), {
            tracing.TASK_ID: d.group.task.task_id, tracing.ROLLOUT_COUNT: len(trained),
            tracing.STALENESS_MAX: max(trained, default=0)}))
    return links


def staleness_attributes(batch: list[GroupDecision]) -> dict[str, float]:
    trained = [s for d in batch for s, m in zip(d.staleness, d.train_mask, strict=True) if m]
    return {tracing.STALENESS_MAX: max(trained, default=0),
            tracing.STALENESS_MEAN: sum(trained) / len(trained) if trained else 0.0}


class TrainerLoop:
    """Fill a batch -> one step -> hand the weights over -> commit when due, until stopped."""

    def __init__(self, cfg: TrainerSettings, policy: TrainedPolicy, intake: Intake, uploader: Uploader,
                 committer: Committer, telemetry: Telemetry, counters: Counters, life: Lifecycle) -> None:
        self.cfg = cfg
        self.policy = policy
        self.intake = intake
        self.assembler = intake.assembler
        self.uploader = uploader
        self.committer = committer
        self.telemetry = telemetry
        self.counters = counters
        self.life = life

    @classmethod
    async def start(cls, run_cfg: RunSettings, cfg: TrainerSettings, policy: TrainedPolicy, *, bus: Bus,
                    life: Lifecycle) -> TrainerLoop:
        """Resume from the latest checkpoint (if any) and wire the parts."""
        subjects = Subjects(run_cfg.run)
        run_dir = Path(run_cfg.run_dir)
        ckpt_dir = run_dir / "checkpoints"
        state = await asyncio.to_thread(checkpoint.load_latest, ckpt_dir, policy.model,
                                        policy.optimizer) or checkpoint.TrainerState()
        book = await asyncio.to_thread(VersionBook.load, ckpt_dir)
        counters = Counters.restore(state.counters)
        committer = Committer(ckpt_dir, policy.model, policy.optimizer, state, counters,
                              checkpoint_every=cfg.checkpoint_every, keep=cfg.checkpoint_keep)
        uploader = Uploader(bus, subjects, make_transport(cfg.transport, bus=bus, root=run_dir), policy.model,
                            model_name=run_cfg.model_name, transport_kind=cfg.transport, book=book)
        assembler = Assembler(batch_groups=run_cfg.batch_groups, max_staleness=run_cfg.max_staleness,
                              lineage=book.lineage, limits=policy.limits)
        board = await asyncio.to_thread(StepBoard, run_dir / "tensorboard", resumed_at=committer.step)
        telemetry = Telemetry(Beat(bus, subjects, "trainer", cfg.instance, period=1.0), counters, assembler, committer,
                              board)
        resumed = committer.resume(await highest_version_used(bus, subjects, run_cfg.model_name, book))
        telemetry.set_version(committer.version)
        if resumed:
            log.info("trainer_resumed", step=committer.step, checkpoint_version=committer.restored_version,
                     version=committer.version + 1, consumed=len(state.consumed))
            # Generators may hold weights of steps lost with the crash: move them to this lineage.
            await asyncio.to_thread(committer.new_lineage, book)
            assembler.lineage = book.lineage
            await uploader.hand_over(committer.version, committer.step)
        intake = Intake(bus.puller(consumer_spec(run_cfg, cfg, subjects), ScoredGroup.decode), assembler, committer,
                        counters, telemetry, batch_groups=run_cfg.batch_groups, fetch_timeout=cfg.fetch_timeout,
                        life=life)
        return cls(cfg, policy, intake, uploader, committer, telemetry, counters, life)

    async def run(self) -> None:
        """Train until stopped.  Graceful stop: what was trained becomes durable and acked, what
        waited for a batch goes back now."""
        self.telemetry.set_state("running")
        self.telemetry.publish()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.telemetry.loop(self.life))
                tg.create_task(self._loop())
            await self.uploader.finish()
            await self.committer.finish()
        finally:
            self.telemetry.close()
            await self.intake.release()

    async def _loop(self) -> None:
        while not self.life.stopping.is_set():
            if self.cfg.max_steps and self.committer.step >= self.cfg.max_steps:
                await self._hold_done()
                continue
            await self.intake.fill_batch()
            if self.life.stopping.is_set():
                break
            await self._step()

    async def _hold_done(self) -> None:
        """``max_steps`` reached: commit what was trained (verified, then settled), then say
        "done" until stopped."""
        await self.committer.finish()
        self.telemetry.set_state("done")
        await self.life.sleep(1.0)

    async def _step(self) -> None:
        batch, dropped = self.assembler.take()
        # The step is a trace of its own, linked to the trace of every group it trains.
        with tracing.root_span(f"train step {self.committer.step + 1}", links=step_links(batch),
                               **{tracing.STEP: self.committer.step + 1, tracing.GROUPS: len(batch),
                                  **staleness_attributes(batch)}) as span:
            await self._traced_step(batch, dropped, span)

    async def _traced_step(self, batch: list[GroupDecision], dropped: list[GroupDecision], span: Span) -> None:
        t_busy = time.perf_counter()
        seqs, batch_stats = pack(batch, self.cfg)
        try:
            metrics = await self._train(seqs, batch)
        except LogprobInputError as exc:
            span.set_attribute(tracing.OUTCOME, "refused_input")
            await self._refuse_step(batch, dropped, exc)
            return
        self.committer.record_step(batch, dropped)
        span.set_attribute(tracing.POLICY_VERSION, self.committer.version)
        span.set_attribute(tracing.REWARD_MEAN, batch_stats["batch/reward_mean"])
        span.set_attribute(tracing.ROLLOUT_COUNT, int(batch_stats["batch/rollouts_trained"]))
        self.counters.groups_trained_total += len(batch)
        self.counters.rollouts_stale_total = self.assembler.rollouts_stale
        await self.uploader.hand_over(self.committer.version, self.committer.step)
        ckpt_s = await self.committer.commit() if self.committer.checkpoint_due else 0.0
        if self.committer.held_drops >= self.assembler.batch_groups:  # bounded: see Committer.settle_drops
            await self.committer.settle_drops()
        # Groups held for the next batch may have aged past the bound with this version.
        self.counters.groups_dropped_total += len(self.assembler.requeue_stale(self.committer.version))
        self.counters.busy_s += time.perf_counter() - t_busy
        metrics.update(batch_stats)
        metrics.update({"time/checkpoint_s": ckpt_s, "time/weight_upload_s": self.uploader.last_upload_s,
                        "time/step_total_s": time.perf_counter() - t_busy})
        self.telemetry.publish_step(self.committer.step,
                                    {k if "/" in k else f"train/{k}": float(v) for k, v in metrics.items()})
        self.telemetry.set_version(self.committer.version)
        with tracing.untraced():  # a heartbeat, not part of the step's trace
            await self.telemetry.send()  # one heartbeat per step carries that step's metrics
        log.info("step", step=self.committer.step, version=self.committer.version,
                 reward=round(batch_stats["batch/reward_mean"], 3), k3=round(metrics.get("mismatch/k3_kl", 0.0), 6),
                 step_s=round(metrics["train/step_s"], 3))

    async def _refuse_step(self, batch: list[GroupDecision], dropped: list[GroupDecision],
                           exc: LogprobInputError) -> None:
        """The step refused its input and changed nothing (no optimiser step, no version): refuse
        the groups at fault like any group that cannot be trained on (ledger ``invalid``, dead-
        lettered with the reason once a checkpoint covers it) and keep training the others."""
        refused = step_refusals(batch, self.policy.limits)
        if not refused:
            # The check names no single group: refusing the whole batch, each with the step's
            # reason, beats dying on it and again on every redelivery.
            refused = {d.group.task.task_id: f"the training step refused a batch holding this group: {exc}"
                       for d in batch}
        log.error("step_refused_input", step=self.committer.step + 1, refused=sorted(refused),
                  given_back=len(batch) - len(refused), error=str(exc))
        self.assembler.put_back(batch, dropped, refused)
        self.counters.groups_dropped_total += len(refused)
        self.telemetry.publish()
        with tracing.untraced():
            await self.telemetry.send()

    async def _train(self, seqs: list[PackedSeq], batch: list[GroupDecision]) -> dict[str, float]:
        """The step in a worker thread, while intake takes in what arrives for the next batch."""
        step = asyncio.ensure_future(asyncio.to_thread(self.policy.train_step, seqs))
        with tracing.untraced():  # what intake does meanwhile (heartbeats) is no part of the step
            await self.intake.prefetch_during(step, {d.group.task.task_id for d in batch})
        return await step
