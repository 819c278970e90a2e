"""The batch driver: from the tasks intake took to the groups the publisher settles, one batch at a time.

Per batch: the environments reset every task (one request per environment name), held-out tasks
get their round's pinned weights, the backend samples in a worker thread (new weights swap in
between decode steps), and the publisher publishes the groups and then acks the tasks.  Tasks
that never reach sampling give their grant back; what fails is naked for another try, or
terminated with the reason when it can never succeed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from pathlib import Path

from bus.protocol import Bus, BusError
from bus.subjects import SubjectError, Subjects
from observability.logging import get_logger
from schemas import EnvReplyBatch, EnvResetBatch, RolloutGroup, SchemaError, Task
from services.generator.backend import Backend
from services.generator.core import Generator, Pins
from services.generator.intake import Held, TaskIntake
from services.generator.publisher import Publisher
from services.generator.settings import GeneratorSettings
from services.generator.status import Status
from services.generator.weight_follower import WeightFollower
from services.runtime.lifecycle import Lifecycle

log = get_logger()

Prompted = tuple[Held, list[int]]  # a task and the prompt ids its environment rendered


class BatchDriver:
    """Takes a batch from intake, resets, samples and hands the groups to the publisher; repeats."""

    ENV_RETRY_S = 2.0  # environment service down or restarting: the tasks come back after this
    SAMPLING_RETRY_S = 5.0  # a backend failure: the tasks come back after this (max_deliver bounds it)
    IDLE_WAIT_S = 0.1  # nothing to take: look again after this, or as soon as a decision or weights arrive

    def __init__(self, bus: Bus, subjects: Subjects, gen: Generator, cfg: GeneratorSettings, *, intake: TaskIntake,
                 weights: WeightFollower, publisher: Publisher, status: Status, life: Lifecycle,
                 slowdown: SlowdownFile) -> None:
        self.bus = bus
        self.subjects = subjects
        self.gen = gen
        self.cfg = cfg
        self.intake = intake
        self.weights = weights
        self.publisher = publisher
        self.status = status
        self.life = life
        self.slowdown = slowdown

    async def loop(self) -> None:
        while not self.life.stopping.is_set():
            self.slowdown.apply(self.gen.backend)
            self.status.show()
            await self.intake.wait_for_fuller_grant(self.cfg.min_batch_groups, self.cfg.batch_wait_s)
            held = await self.intake.take()
            if held:
                await self.drive(held)
            else:
                await self._idle()

    async def _idle(self) -> None:
        # Nothing in hand: swap staged weights in now instead of at the next batch's first decode step.
        if await asyncio.to_thread(self.gen.backend.apply_staged):
            self.status.show()
        await self.status.wait_for_change(self.IDLE_WAIT_S)

    async def drive(self, held: list[Held]) -> None:
        """One batch, from reset to settled (or handed back)."""
        n_train = sum(not h.is_eval for h in held)
        self.gen.begin_batch(n_train, len(held), redelivered=sum(h.delivery.deliveries > 1 for h in held))
        try:
            t_env = time.perf_counter()
            ready = await self._reset(held)
            if not ready:
                return
            t_sample = time.perf_counter()
            groups = await self._sample(ready)
            if groups is None:
                return
            self.status.show()
            t_publish = time.perf_counter()
            await self.publisher.settle([h for h, _ in ready], groups)
            n_eval = sum(h.is_eval for h, _ in ready)
            log.debug("batch", train=len(ready) - n_eval, eval=n_eval, version=self.gen.backend.version,
                      grant=self.gen.grant_total, started=self.gen.started, env_s=round(t_sample - t_env, 4),
                      sample_s=round(t_publish - t_sample, 4), publish_s=round(time.perf_counter() - t_publish, 4))
        finally:
            self.gen.end_batch()

    # --- environments ------------------------------------------------------------------------------
    async def _reset(self, held: list[Held]) -> list[Prompted]:
        """The prompt ids of every task, one environment round trip per environment name in the
        batch.  Tasks handed back (environment unavailable) or refused (dead-lettered) are left out,
        and the grant their training groups took is given back: they never started."""
        by_env: dict[str, list[int]] = defaultdict(list)
        for i, h in enumerate(held):
            by_env[h.task.env].append(i)
        answers = await asyncio.gather(*(self._reset_env(env, [held[i] for i in idx]) for env, idx in by_env.items()))
        prompts: list[list[int] | None] = [None] * len(held)
        for idx, answer in zip(by_env.values(), answers, strict=True):
            for i, p in zip(idx, answer, strict=True):
                prompts[i] = p
        ready = [(h, p) for h, p in zip(held, prompts, strict=True) if p is not None]
        self.gen.give_back(sum(not h.is_eval for h in held) - sum(not h.is_eval for h, _ in ready))
        return ready

    async def _reset_env(self, env: str, held: list[Held]) -> list[list[int] | None]:
        try:
            subject = self.subjects.env(env, "reset_batch")
        except SubjectError as exc:
            await self._refuse(held, f"environment name {env!r} cannot be addressed: {exc}")
            return [None] * len(held)
        try:
            raw = await self.bus.request(subject, EnvResetBatch(tasks=[h.task for h in held]).encode(),
                                         timeout=self.cfg.env_timeout)
            reply = EnvReplyBatch.decode(raw)
            problem = reply.error or ("" if len(reply.replies) == len(held) else
                                      f"{len(reply.replies)} replies for {len(held)} resets")
        except (BusError, SchemaError) as exc:
            problem = str(exc)
        if problem:
            for h in held:
                await h.delivery.nak(delay=self.ENV_RETRY_S)
            log.warning("env_unavailable", tasks=len(held), env=env, error=problem)
            return [None] * len(held)
        prompts: list[list[int] | None] = []
        for h, r in zip(held, reply.replies, strict=True):
            if r.error:
                await self._refuse([h], f"environment refused task {h.task.task_id!r}: {r.error}")
                prompts.append(None)
            else:
                prompts.append([int(t) for t in r.observation_ids])
        return prompts

    async def _refuse(self, held: list[Held], reason: str) -> None:
        """Tasks that can never succeed here: terminated and dead-lettered with the reason."""
        for h in held:
            self.gen.dead += 1
            await h.delivery.term(reason)

    # --- sampling ----------------------------------------------------------------------------------
    async def _sample(self, ready: list[Prompted]) -> list[RolloutGroup] | None:
        """The batch's groups, in ``ready``'s order; None when sampling failed (the tasks were
        naked for a later try and their grant given back)."""
        try:
            pins = await self.weights.pins_for([h.task for h, _ in ready])
            return await self._play([(h.task, p) for h, p in ready], pins)
        except Exception as exc:  # a backend failure must not kill the service or lose tasks
            log.exception("sampling_failed", tasks=len(ready), error=repr(exc))
            for h, _ in ready:
                await h.delivery.nak(delay=self.SAMPLING_RETRY_S)  # after max_deliver the advisory dead-letters it
            self.gen.give_back(sum(not h.is_eval for h, _ in ready))
            return None

    async def _play(self, batch: list[tuple[Task, list[int]]], pins: Pins) -> list[RolloutGroup]:
        """Play the batch's episodes to their end.  Single-turn environments end after the one
        completion, so that is one backend call.  A multi-turn episode driver plugs in here:
        per turn, sample, send each live episode's action to ``rl.<run>.env.<name>.step`` (EnvStep),
        append the observation ids with loss_mask 0, until every episode is done or out of budget."""
        return await asyncio.to_thread(self.gen.sample, batch, pins)


class SlowdownFile:
    """Testing aid (``slowdown_file``): the slowdown factor in a file, applied when the file changes."""

    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self._mtime = -1.0

    def apply(self, backend: Backend) -> None:
        if self.path is None or not hasattr(backend, "slowdown"):
            return
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime == self._mtime:
                return
            self._mtime = mtime
            factor = float(self.path.read_text().strip() or 1.0)
        except (OSError, ValueError) as exc:
            log.warning("slowdown_file_unreadable", path=str(self.path), error=str(exc),
                        hint="write one number >= 1 into the file")
            return
        if factor >= 1.0 and factor != backend.slowdown:
            log.info("slowdown_changed", old=backend.slowdown, new=factor)
            backend.slowdown = factor
