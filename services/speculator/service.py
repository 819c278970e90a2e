"""speculator service — distil the draft model online on the policy's own samples and hand its
versions to weight-broadcast, so generators with drafter "model" draft with a draft that follows
the drifting policy.

consumes:  rl.<run>.scored.<pool>  (ScoredGroup)  durable 'speculator' on SCORED, every training pool: its
             own durable (the trainer's is separate; SCORED is a limits stream, kept for replay), acked once
             the group's rollouts are in the buffer
produces:  rl.<run>.uploads.<model>-draft  (WeightManifest state=uploaded, UPLOADS)  msg id
             'upload.<model>-draft.v<N>', every ``publish_every`` distillation steps; its ``policy_version``
             is the newest policy version of the samples the draft was distilled on
           rl.<run>.metrics.speculator.<instance>  (Heartbeat)  SpeculatorKeys: loss, steps, samples, published
             version, policy_version_lag
           rl.<run>.dead.scored  a group that does not decode or cannot be trained on (ids outside the draft's
             vocabulary, past its context, a mask that does not fit), with the reason
reads:     rl.<run>.weights.<model>-draft (last) once at start: resumes from the newest published draft
waits for: ``batch_samples`` buffered rollouts per step
unblocked by: the reward service publishing scored groups

The draft's model name is ``rlbus.bus.subjects.draft_model_name(model_name)``; weight-broadcast verifies
and announces its versions like the policy's, and generators with drafter "model" stage them
between target forwards.  Uploads go through the trainer's path (services/policy/upload.py), with
their numbers in ``<run_dir>/speculator/draft_versions.json`` (learner.DraftBook).

What a restart keeps: the draft's weights (the newest published version, read back through its
transport; the ``draft_model_path`` folder when none is readable) and the numbering.  What it
loses: the optimiser's moments (AdamW starts afresh, as after a warm start) and the buffered
rollouts, which were acked on arrival: they were a sample of the stream, not a ledger, and SCORED
brings newer ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rlbus.bus.protocol import Bus, BusError, ConsumerSpec, Delivery, Poison
from rlbus.bus.subjects import Subjects, draft_model_name
from rlbus.observability.logging import get_logger
from rlbus.schemas import SchemaError, ScoredGroup, WeightManifest
from rlbus.services.policy.distill import DistillInputError, DraftDistiller
from rlbus.services.policy.errors import PolicyError
from rlbus.services.policy.load import load_policy, load_state_from_safetensors
from rlbus.services.policy.upload import Uploader
from rlbus.services.runtime.config import ConfigError, RunSettings
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped
from rlbus.services.runtime.weights import WeightTransport, make_transport
from rlbus.services.speculator.learner import DraftBook, Learner
from rlbus.services.speculator.settings import SpeculatorSettings

log = get_logger()


def consumer_spec(run_cfg: RunSettings, cfg: SpeculatorSettings, subjects: Subjects) -> ConsumerSpec:
    """The durable 'speculator' on every training pool's scored groups (held-out rounds are greedy
    and sampled plainly: nothing there to distil)."""
    pools = [p for p in run_cfg.pools if p != run_cfg.eval_pool]
    return ConsumerSpec(stream="SCORED", durable=subjects.durable("speculator"),
                        filter_subjects=tuple(subjects.scored(p) for p in pools), ack_wait=60.0,
                        max_deliver=cfg.max_deliver, max_ack_pending=max(64, 2 * cfg.buffer_samples))


class SpeculatorService:
    """Scored groups into the learner's buffer; minibatch steps; every ``publish_every`` steps a
    new draft version to weight-broadcast; a heartbeat with the learner's metrics."""

    def __init__(self, run_cfg: RunSettings, cfg: SpeculatorSettings, *, bus: Bus, life: Lifecycle, learner: Learner,
                 transport: WeightTransport, book: DraftBook) -> None:
        self.cfg = cfg
        self.bus = bus
        self.life = life
        self.learner = learner
        self.transport = transport
        self.book = book
        self.subjects = Subjects(run_cfg.run)
        self.model_name = draft_model_name(run_cfg.model_name)
        self.uploader = Uploader(bus, self.subjects, transport, learner.distiller.draft, model_name=self.model_name,
                                 transport_kind=cfg.transport, book=book)
        self.spec = consumer_spec(run_cfg, cfg, self.subjects)
        self.beat = Beat(bus, self.subjects, "speculator", cfg.instance, period=1.0)
        self.beat.extra = learner.metrics  # SpeculatorKeys; the draft version is speculator/published_version
        self.ready = asyncio.Event()  # a full minibatch is buffered

    @classmethod
    async def build(cls, run_cfg: RunSettings, cfg: SpeculatorSettings, *, bus: Bus, life: Lifecycle) -> SpeculatorService:
        if not cfg.draft_model_path:
            raise ConfigError(
                "[speculator] draft_model_path is empty: set it to the draft folder the generators start from "
                "([generator.speculative] draft_model_path; `rlbus up` copies it), built with "
                "rlbus.services.policy.draft_model.build_draft + save_draft")
        draft, _ = await asyncio.to_thread(load_policy, cfg.draft_model_path)
        learner = Learner(DraftDistiller(draft, lr=cfg.lr), batch_samples=cfg.batch_samples,
                          buffer_samples=cfg.buffer_samples)
        book = await asyncio.to_thread(DraftBook, Path(run_cfg.run_dir) / "speculator")
        return cls(run_cfg, cfg, bus=bus, life=life, learner=learner,
                   transport=make_transport(cfg.transport, bus=bus, root=run_cfg.run_dir), book=book)

    async def resume(self) -> None:
        """Number on from the newest published draft and continue from its weights, if they can be
        read; else from the folder's weights (still numbering above it: weight-broadcast would take
        a lower number for a duplicate and drop it)."""
        subject = self.subjects.weights(self.model_name)
        raw = await self.bus.last(subject, wait=True)
        if raw is None:
            return
        try:
            manifest = WeightManifest.decode(raw)
        except SchemaError as exc:
            log.warning("unreadable_draft_manifest", subject=subject, error=str(exc)[:500],
                        todo="distilling on from draft_model_path, numbered above the book's highest version")
            return
        c = self.learner.c
        c.published_version = max(c.published_version, manifest.version)
        try:
            data = await self.transport.read(manifest.shards[0])
            await asyncio.to_thread(load_state_from_safetensors, self.learner.distiller.draft, data)
        except (BusError, OSError, RuntimeError, PolicyError) as exc:
            log.warning("draft_resume_failed", subject=subject, version=manifest.version,
                        error=f"{type(exc).__name__}: {exc}"[:500],
                        todo="distilling on from draft_model_path; version numbers continue above the last")
            return
        c.published_on = self.learner.trained_on = manifest.policy_version
        log.info("draft_resumed", version=manifest.version, policy_version=manifest.policy_version)

    def workers(self) -> tuple[Callable[[], Awaitable[None]], ...]:
        """Every loop the service runs, for ``run_until_stopped``."""
        return (lambda: self.beat.loop(self.life), self.distill_loop,
                lambda: self.bus.consume(self.spec, ScoredGroup.decode, self.on_group, batch=16))

    async def on_group(self, group: ScoredGroup, d: Delivery[ScoredGroup]) -> None:
        """Buffer the group's rollouts (returning acks it); a group that can never be trained on is
        dead-lettered with the reason, and the next one is taken as usual."""
        try:
            skipped = self.learner.offer(group)
        except DistillInputError as exc:
            self.learner.c.groups_dead += 1
            raise Poison(f"group {group.task.task_id}: cannot be distilled on ({exc}); the draft skips it, the "
                         "trainer judges it on its own") from None
        if skipped is not None:
            log.debug("group_skipped", task_id=group.task.task_id, why=skipped)
        # The heartbeat's version is the policy's, as for every service (the draft's is a metric).
        self.beat.version = self.learner.c.policy_version
        if self.learner.batch_ready:
            self.ready.set()

    async def distill_loop(self) -> None:
        try:
            while not self.life.stopping.is_set():
                if not self.learner.batch_ready:
                    self.ready.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):  # and look at life.stopping again
                            await self.ready.wait()
                    continue
                await self.step_once()
        finally:
            # A stop (a cancel within the lifecycle's grace) still hands over the version in flight.
            await self.uploader.finish()

    async def step_once(self) -> None:
        batch, policy_version = self.learner.take_batch()
        t0 = time.perf_counter()
        try:
            loss = await asyncio.to_thread(self.learner.distil, batch)
        except DistillInputError as exc:  # a non-finite loss: the draft was not updated
            log.error("distill_step_refused", error=str(exc), todo="lower [speculator] lr if this repeats")
            return
        self.learner.record_step(loss, policy_version)
        self.beat.metrics["speculator/step_s"] = time.perf_counter() - t0
        if self.learner.c.steps % self.cfg.publish_every == 0:
            await self.publish()

    async def publish(self) -> None:
        """Hand the draft's weights over as the next version (uploaded in the background)."""
        c = self.learner.c
        version = max(c.published_version, self.book.highest) + 1
        await self.uploader.hand_over(version, c.steps, policy_version=self.learner.trained_on)
        c.published_version, c.published_on = version, self.learner.trained_on
        log.info("draft_handed_over", version=version, policy_version=self.learner.trained_on, steps=c.steps,
                 loss=round(c.loss, 4))


async def run(run_cfg: RunSettings, cfg: SpeculatorSettings, *, bus: Bus, life: Lifecycle) -> None:
    service = await SpeculatorService.build(run_cfg, cfg, bus=bus, life=life)
    await service.resume()
    service.beat.state = "running"
    await run_until_stopped(life, *service.workers())
