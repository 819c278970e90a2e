"""generator service — sample groups for tasks, within the controller's admission grant.

consumes:  rl.<run>.tasks.<pool>          (Task)            durable 'generator_<pool>' shared by replicas
           rl.<run>.weights.<model>       (WeightManifest)  latest on join, then every new version
           rl.<run>.control.generator.<instance>  (Control 'admit': cumulative grant for this boot)
calls:     rl.<run>.env.<name>.reset (EnvReset -> EnvReply: prompt tokens, or an error)
produces:  rl.<run>.rollouts.<pool>       (RolloutGroup)    msg id 'rollouts.<task_id>'
waits for: admission (grant_total > groups started) for training pools; eval tasks are not admitted
A task is acked only after its group is published (a crash redelivers it; the msg id dedupes the
re-publish).  A task the environment refuses is terminated and dead-lettered with the reason.
New weights are fetched and digest-verified in the background and swapped between decode steps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from collections import defaultdict

import numpy as np

from bus.protocol import Bus, BusError, ConsumerSpec, Delivery
from bus.subjects import Subjects
from observability.logging import get_logger
from schemas import (
    Control,
    EnvReply,
    EnvReset,
    Rollout,
    RolloutGroup,
    SchemaError,
    Task,
    WeightManifest,
    spans_from_versions,
)
from services.generator.backend import BACKENDS, Backend
from services.generator.settings import GeneratorSettings
from services.runtime.config import RunSettings
from services.runtime.heartbeat import Beat
from services.runtime.lifecycle import Lifecycle, run_until_stopped
from services.runtime.weights import WeightIntegrityError, make_transport

log = get_logger()


class Generator:
    """The I/O-free core: turns (task, prompt ids) batches into rollout groups."""

    def __init__(self, backend: Backend, cfg: GeneratorSettings) -> None:
        self.backend = backend
        self.cfg = cfg
        self.boot = uuid.uuid4().hex[:8]
        self.grant_total = 0 if cfg.admission else 1 << 62
        self.started = 0
        self.published = 0
        self.eval_published = 0
        self.dead = 0
        self.paused = False
        self.min_version = 0  # the controller's freshness floor: older weights would yield stale samples
        self.in_flight = 0
        self.batches = 0
        self._t0 = time.time()
        self._rate_window: list[tuple[float, int]] = []

    @property
    def budget(self) -> int:
        if self.paused or self.backend.version < self.min_version:
            return 0
        return max(self.grant_total - self.started, 0)

    def on_control(self, ctl: Control) -> None:
        if ctl.action == "admit" and str(ctl.params.get("boot")) == self.boot:
            self.grant_total = max(self.grant_total, int(ctl.params["grant_total"]))
            self.min_version = max(self.min_version, int(ctl.params.get("min_version", 0)))
        elif ctl.action == "pause":
            self.paused = True
        elif ctl.action == "resume":
            self.paused = False

    def sample(self, batch: list[tuple[Task, list[int]]]) -> list[RolloutGroup]:
        """Blocking (run in a worker thread): one backend call per distinct sampling setting."""
        by_params: dict[tuple[bytes, int], list[int]] = defaultdict(list)
        for i, (task, _) in enumerate(batch):
            by_params[(task.sampling.encode(), task.group_size)].append(i)
        groups: list[RolloutGroup | None] = [None] * len(batch)
        for (_, n), idx in by_params.items():
            sampling = batch[idx[0]][0].sampling
            prompts = [batch[i][1] for i in idx]
            stop_ids = [self.backend.eos_id] if self.backend.eos_id is not None else []
            seed = zlib.crc32(f"{self.cfg.seed}/{self.cfg.instance}/{self.batches}".encode())
            t0 = time.time()
            outs = self.backend.sample(prompts, n, sampling, stop_ids, seed)
            t1 = time.time()
            for i, samples in zip(idx, outs, strict=True):
                task, prompt = batch[i]
                rollouts = []
                for k, s in enumerate(samples):
                    ids = np.asarray([*prompt, *s.completion_ids], dtype="<i4")
                    rollouts.append(Rollout(
                        rollout_id=f"{task.task_id}:{k}", task_id=task.task_id, index=k, token_ids=ids,
                        prompt_len=len(prompt), loss_mask=np.ones(len(s.completion_ids), dtype="|u1"),
                        behaviour_logprobs=np.asarray(s.behaviour_logprobs, dtype="<f4"),
                        version_spans=spans_from_versions(s.token_versions), finish_reason=s.finish_reason,
                        text=self.backend.decode(s.completion_ids), generator_id=self.cfg.instance,
                        timings={"sample_s": t1 - t0},
                    ))
                groups[i] = RolloutGroup(task=task, rollouts=rollouts, sampling=sampling, generator_id=self.cfg.instance,
                                         created_at=time.time())
        self.batches += 1
        return [g for g in groups if g is not None]

    def note_published(self, n_train: int, n_eval: int) -> None:
        self.published += n_train
        self.eval_published += n_eval
        now = time.time()
        self._rate_window.append((now, self.published))
        self._rate_window = [(t, c) for t, c in self._rate_window if now - t < 10.0]

    def metrics(self) -> dict[str, float]:
        rate = 0.0
        if len(self._rate_window) >= 2:
            (t0, c0), (t1, c1) = self._rate_window[0], self._rate_window[-1]
            rate = (c1 - c0) / max(t1 - t0, 1e-6)
        return {"generator/groups_started": self.started, "generator/groups_published": self.published,
                "generator/eval_groups_published": self.eval_published, "generator/grant_total": min(self.grant_total, 1 << 40),
                "generator/groups_per_s": rate, "generator/in_flight": self.in_flight, "generator/dead_lettered": self.dead,
                "generator/paused": float(self.paused), "generator/min_version": self.min_version,
                **self.backend.metrics()}


async def run(run_cfg: RunSettings, cfg: GeneratorSettings, *, bus: Bus, life: Lifecycle) -> None:
    subjects = Subjects(run_cfg.run)
    backend: Backend = await asyncio.to_thread(
        BACKENDS.create, cfg.backend, model_path=run_cfg.model_path, dtype=cfg.dtype, deterministic=cfg.deterministic,
        slowdown=cfg.slowdown)
    gen = Generator(backend, cfg)
    transport = make_transport(cfg.transport, bus=bus, root=run_cfg.run_dir)
    beat = Beat(bus, subjects, "generator", cfg.instance, period=0.5)
    beat.info = {"boot": gen.boot, "backend": cfg.backend}
    beat.extra = gen.metrics
    wake = asyncio.Event()
    train_pools = [p for p in (cfg.pools or run_cfg.pools) if p != run_cfg.eval_pool]
    eval_pools = [run_cfg.eval_pool] if not cfg.pools or run_cfg.eval_pool in cfg.pools else []

    def puller(pool: str):  # type: ignore[no-untyped-def]
        spec = ConsumerSpec(stream="TASKS", durable=subjects.durable("generator", pool),
                            filter_subjects=(subjects.tasks(pool),), ack_wait=60, max_deliver=5,
                            max_ack_pending=max(4 * run_cfg.admission_window_groups, 256))
        return bus.puller(spec, Task.decode)

    train_pullers = {p: puller(p) for p in train_pools}
    eval_pullers = {p: puller(p) for p in eval_pools}

    async def follow_weights() -> None:
        async for d in bus.watch(subjects.weights(run_cfg.model_name), deliver="last_per_subject"):
            try:
                manifest = WeightManifest.decode(d.msg)
                if manifest.version <= backend.version:
                    continue
                t0 = time.perf_counter()
                data = await transport.read(manifest.shards[0])
                await asyncio.to_thread(backend.stage, manifest.version, data)
                beat.metrics["generator/weight_fetch_s"] = time.perf_counter() - t0
                log.info("weights_staged", version=manifest.version, fetch_s=round(time.perf_counter() - t0, 4))
                wake.set()
            except (SchemaError, WeightIntegrityError, BusError, ValueError) as exc:
                gen.dead += 1
                log.error("weights_refused", error=str(exc))
                await bus.dead_letter(d.subject, d.msg, reason="weights_refused", error=f"{type(exc).__name__}: {exc}")

    async def follow_control() -> None:
        async def one(subject: str) -> None:
            async for d in bus.watch(subject, deliver="last_per_subject"):
                try:
                    gen.on_control(Control.decode(d.msg))
                    wake.set()
                except SchemaError as exc:
                    await bus.dead_letter(d.subject, d.msg, reason="schema_error", error=f"SchemaError: {exc}")

        async with asyncio.TaskGroup() as tg:
            tg.create_task(one(subjects.control("generator", cfg.instance)))
            tg.create_task(one(subjects.control("generator", "all")))

    async def prompt_of(d: Delivery[Task]) -> list[int] | None:
        task = d.msg
        try:
            raw = await bus.request(subjects.env(task.env, "reset"), EnvReset(task=task).encode(), timeout=cfg.env_timeout)
            reply = EnvReply.decode(raw)
        except (BusError, SchemaError) as exc:
            await d.nak(delay=2.0)  # environment service down or restarting: try again later
            log.warning("env_unavailable", task=task.task_id, env=task.env, error=str(exc))
            return None
        if reply.error:
            gen.dead += 1
            await d.term(f"environment refused task {task.task_id!r}: {reply.error}")
            return None
        return [int(i) for i in reply.observation_ids]

    async def gather() -> list[tuple[Delivery[Task], bool]]:
        """Eval tasks first (never admitted), then training tasks within the grant."""
        got: list[tuple[Delivery[Task], bool]] = []
        # A held-out round is hundreds of single greedy samples: take it in one backend call
        # (sized like one training batch in sequences) rather than many small ones, which cost
        # a decode loop each and delay the training batch behind them.
        eval_room = cfg.max_batch_groups * run_cfg.group_size
        for p in eval_pullers.values():
            for d in await p.fetch(eval_room, timeout=0.01):
                got.append((d, True))
        room = min(gen.budget, cfg.max_batch_groups)
        for p in train_pullers.values():
            if room <= 0:
                break
            batch = await p.fetch(room, timeout=0.05)
            got.extend((d, False) for d in batch)
            room -= len(batch)
        return got

    async def work() -> None:
        while not life.stopping.is_set():
            deliveries = await gather()
            if not deliveries:
                if await asyncio.to_thread(backend.apply_staged):
                    beat.version = backend.version
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), timeout=0.1)
                except TimeoutError:
                    pass
                continue
            n_train = sum(not e for _, e in deliveries)
            gen.started += n_train
            gen.in_flight = len(deliveries)
            batch, kept = [], []
            t_env = time.perf_counter()
            # Environment resets of a batch run concurrently (one round trip, not one per task).
            prompts = await asyncio.gather(*(prompt_of(d) for d, _ in deliveries))
            t_sample = time.perf_counter()
            for (d, is_eval), prompt in zip(deliveries, prompts, strict=True):
                if prompt is None:
                    if not is_eval:
                        gen.started -= 1  # never started: give the slot back
                    continue
                batch.append((d.msg, prompt))
                kept.append((d, is_eval))
            if not batch:
                continue
            try:
                groups = await asyncio.to_thread(gen.sample, batch)
            except Exception as exc:  # a backend failure must not kill the service or lose tasks
                log.exception("sampling_failed", tasks=len(kept), error=repr(exc))
                for d, is_eval in kept:
                    await d.nak(delay=5.0)  # redelivered; after max_deliver the advisory dead-letters it
                    gen.started -= 0 if is_eval else 1
                gen.in_flight = 0
                continue
            beat.version = backend.version
            t_publish = time.perf_counter()
            items = []
            # Single-turn environments end after the one completion; the multi-turn loop
            # (EnvStep per turn, observations appended with loss_mask 0) plugs in here.
            for g, (d, _) in zip(groups, kept, strict=True):
                items.append((subjects.rollouts(d.msg.pool), g.encode(), f"rollouts.{g.task.task_id}"))
            await bus.publish_many(items)
            for d, _ in kept:
                await d.ack()
            gen.note_published(sum(not e for _, e in kept), sum(e for _, e in kept))
            t_done = time.perf_counter()
            log.debug("batch", train=sum(not e for _, e in kept), eval=sum(e for _, e in kept), version=backend.version,
                      grant=gen.grant_total, started=gen.started, env_s=round(t_sample - t_env, 4),
                      sample_s=round(t_publish - t_sample, 4), publish_s=round(t_done - t_publish, 4))
            gen.in_flight = 0

    beat.state = "running"
    log.info("generator_ready", backend=cfg.backend, pools=train_pools + eval_pools, boot=gen.boot)
    await run_until_stopped(life, lambda: beat.loop(life), follow_weights, follow_control, work)
