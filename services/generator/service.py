"""generator service — sample groups for tasks, within the controller's admission grant and routing.

consumes:  rl.<run>.tasks.<pool>          (Task)            durable 'generator_<pool>' shared by replicas
           rl.<run>.weights.<model>       (WeightManifest)  latest on join, then every new version
           rl.<run>.control.generator.<instance|all>.<action>  (Control) the last of each action on join:
             'admit' cumulative grant for this boot (the newest holds) + freshness floor; 'assign_pools' pools in priority
             order and the share of starts per pool; 'concurrency' most groups per batch;
             'pause' / 'resume' / 'drain' (finish what it holds, start nothing more, drop its grant)
calls:     rl.<run>.env.<name>.reset_batch (EnvResetBatch -> EnvReplyBatch: per task prompt tokens, or an
             error), one request per environment name in a batch
produces:  rl.<run>.rollouts.<pool>       (RolloutGroup)    msg id 'rollouts.<task_id>'
waits for: admission (grant_total > groups started) for training pools; eval tasks are not admitted
Held-out tasks carry the version their round was scheduled at (metadata 'eval_version'); with
eval_weights='pinned' they are sampled on a second copy of the model holding exactly that version,
read through the transport its manifest names, so a round is scored on one version.
A task is acked only after its group is published (a crash redelivers it; the msg id dedupes the
re-publish).  Held tasks get in-progress heartbeats well within TASK_ACK_WAIT, so the tasks of a
generator killed with -9 come back to the others within seconds.  A task the environment refuses
is terminated and dead-lettered with the reason.  New weights are fetched and digest-verified in
the background and swapped between decode steps.  A new pool assignment applies from the next
batch: tasks already fetched are finished, never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
import zlib
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from bus.protocol import Bus, BusError, ConsumerSpec, Delivery
from bus.subjects import Subjects
from observability.logging import get_logger
from schemas import (
    Control,
    EnvReply,
    EnvReplyBatch,
    EnvResetBatch,
    Rollout,
    RolloutGroup,
    SchemaError,
    Task,
    WeightManifest,
    spans_from_versions,
)
from services.generator.backend import BACKENDS, Backend, PinnedSampling, cut_at_stop
from services.generator.settings import GeneratorSettings
from services.runtime.config import RunSettings
from services.runtime.heartbeat import Beat
from services.runtime.lifecycle import Lifecycle, run_until_stopped
from services.runtime.weights import WeightIntegrityError, WeightTransport, make_transport

log = get_logger()

# Seconds before the server hands an un-acked task to another replica.  Held tasks are heartbeated
# (in_progress) every third of it, so only a generator that died loses them, for about this long.
TASK_ACK_WAIT = 8.0
STATE_ACTIONS = ("pause", "resume", "drain")


class Generator:
    """The I/O-free core: turns (task, prompt ids) batches into rollout groups, and keeps the
    controller's decisions (grant, routing, concurrency, run state)."""

    def __init__(self, backend: Backend, cfg: GeneratorSettings, pools: list[str] | None = None) -> None:
        self.backend = backend
        self.cfg = cfg
        self.boot = uuid.uuid4().hex[:8]
        self.grant_total = 0 if cfg.admission else 1 << 62
        self.started = 0
        self.published = 0
        self.eval_published = 0
        self.dead = 0
        self.mode = "running"  # running | paused | draining
        self.min_version = 0  # the controller's freshness floor: older weights would yield stale samples
        self.in_flight = 0
        self.batches = 0
        self.allowed_pools = list(pools or [])  # training pools this replica may serve (its config)
        self.pools = list(self.allowed_pools)  # in priority order (the controller's routing)
        self.shares: dict[str, float] = {}  # share of starts per pool ({} = first pool with work)
        self.concurrency = cfg.max_batch_groups
        self.published_by_pool: Counter[str] = Counter()
        self.redelivered = 0  # tasks received again (another replica died or timed out holding them)
        self._taken: Counter[str] = Counter()  # groups asked of each pool since the routing changed
        self._seq: dict[str, int] = {}  # last applied seq per kind of decision (pause/resume/drain share one)
        self._grant_floor_seq = -1  # admits older than the last drain are void
        self._t0 = time.time()
        self._rate_window: list[tuple[float, int]] = []
        self.eval_pinned = 0  # held-out groups sampled at exactly their round's version
        self.eval_unpinned = 0  # ... on the live weights, because that version could not be read

    @property
    def paused(self) -> bool:
        return self.mode != "running"

    @property
    def state(self) -> str:
        """For the heartbeat: running | paused | draining | drained (nothing held any more)."""
        return "drained" if self.mode == "draining" and self.in_flight == 0 else self.mode

    @property
    def budget(self) -> int:
        if self.paused or self.backend.version < self.min_version:
            return 0
        return max(self.grant_total - self.started, 0)

    @property
    def batch_cap(self) -> int:
        return max(min(self.cfg.max_batch_groups, self.concurrency), 1)

    def on_control(self, ctl: Control) -> str | None:
        """Apply one decision; returns what changed (for the log), None when it did not apply.

        Decisions of one kind apply in ``seq`` order (a replayed older one is ignored); those that
        carry a ``boot`` apply only to that boot, so a restarted replica ignores its predecessor's."""
        kind = "state" if ctl.action in STATE_ACTIONS else ctl.action
        boot = ctl.params.get("boot")
        if (boot is not None and str(boot) != self.boot) or ctl.seq <= self._seq.get(kind, -1):
            return None
        if ctl.action == "admit":
            if boot is None or ctl.seq < self._grant_floor_seq or not self.cfg.admission:
                return None
            # The newest grant holds, also when lower: the controller takes back unstarted groups from
            # a generator that slowed, and re-grants them only once this heartbeat reports the drop.
            self.grant_total = max(int(ctl.params["grant_total"]), self.started)
            self.min_version = max(self.min_version, int(ctl.params.get("min_version", 0)))
        elif ctl.action in STATE_ACTIONS:
            if ctl.action == "drain":
                # What it has not started goes back to the controller, which re-plans it once the
                # heartbeat says 'draining'; grants issued before this one are void.
                self.grant_total = min(self.grant_total, self.started)
                self._grant_floor_seq = ctl.seq
            elif ctl.action == "resume" and not self.cfg.admission:
                self.grant_total = 1 << 62
            self.mode = {"pause": "paused", "resume": "running", "drain": "draining"}[ctl.action]
        elif ctl.action == "assign_pools":
            pools = [str(p) for p in ctl.params.get("pools", []) if str(p) in self.allowed_pools]
            if not pools:
                log.warning("pools_refused", offered=ctl.params.get("pools"), allowed=self.allowed_pools)
                return None
            shares = {str(p): float(w) for p, w in dict(ctl.params.get("shares", {})).items() if p in pools and w > 0}
            if (pools, shares) != (self.pools, self.shares):
                self._taken.clear()
            self.pools, self.shares = pools, shares
        elif ctl.action == "concurrency":
            self.concurrency = max(min(int(ctl.params["max_groups"]), self.cfg.max_batch_groups), 1)
        else:
            return None
        self._seq[kind] = ctl.seq
        return f"{ctl.action} {ctl.params}"

    def split_room(self, room: int) -> list[tuple[str, int]]:
        """How many of ``room`` training groups to ask of each pool: by the routed shares, each next
        group to the pool furthest behind its share of what was taken since the routing changed."""
        if room <= 0 or not self.pools:
            return []
        shares = {p: w for p, w in self.shares.items() if p in self.pools} or {self.pools[0]: 1.0}
        total = sum(self._taken.values()) + room
        alloc: Counter[str] = Counter()
        for _ in range(room):
            p = max(shares, key=lambda q: (shares[q] * total - self._taken[q] - alloc[q], -self.pools.index(q)))
            alloc[p] += 1
        return [(p, alloc[p]) for p in self.pools if alloc[p] > 0]

    def note_taken(self, pool: str, n: int) -> None:
        self._taken[pool] += n

    @staticmethod
    def eval_version(task: Task) -> int | None:
        """The version a held-out task's round was scheduled at (None: not a held-out task)."""
        v = task.metadata.get("eval_version") if task.eval else None
        return int(v) if isinstance(v, int) and v >= 0 else None

    def sample(self, batch: list[tuple[Task, list[int]]],
               pins: dict[int, bytes | memoryview | None] | None = None) -> list[RolloutGroup]:
        """Blocking (run in a worker thread): one backend call per distinct sampling setting and
        pinned version.  ``pins`` holds the weights of each held-out version to sample at exactly
        (None: the backend's pinned copy already holds it); other tasks use the live weights."""
        pins = pins or {}
        by_params: dict[tuple[bytes, int, int | None], list[int]] = defaultdict(list)
        for i, (task, _) in enumerate(batch):
            v = self.eval_version(task)
            by_params[(task.sampling.encode(), task.group_size, v if v in pins else None)].append(i)
        groups: list[RolloutGroup | None] = [None] * len(batch)
        # The version the pinned copy holds (weights None) goes first, before another round's load replaces it.
        held = next((v for v, w in pins.items() if w is None), None)
        calls = sorted(by_params.items(), key=lambda kv: kv[0][2] != held)
        for (_, n, pin), idx in calls:
            sampling = batch[idx[0]][0].sampling
            prompts = [batch[i][1] for i in idx]
            stop_ids = [self.backend.eos_id] if self.backend.eos_id is not None else []
            seed = zlib.crc32(f"{self.cfg.seed}/{self.cfg.instance}/{self.batches}".encode())
            t0 = time.time()
            if pin is not None and isinstance(self.backend, PinnedSampling):
                outs = self.backend.sample_at(pin, pins[pin], prompts, n, sampling, stop_ids, seed)
                self.eval_pinned += len(idx)
            else:
                outs = self.backend.sample(prompts, n, sampling, stop_ids, seed)
                self.eval_unpinned += sum(self.eval_version(batch[i][0]) is not None for i in idx)
            t1 = time.time()
            for i, samples in zip(idx, outs, strict=True):
                task, prompt = batch[i]
                rollouts = []
                for k, s in enumerate(samples):
                    if sampling.stop:
                        s = cut_at_stop(s, sampling.stop, self.backend.decode)
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

    def note_published(self, n_train: int, n_eval: int, by_pool: Counter[str] | None = None) -> None:
        self.published += n_train
        self.eval_published += n_eval
        self.published_by_pool.update(by_pool or {})
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
                "generator/concurrency": self.batch_cap, "generator/tasks_redelivered": self.redelivered,
                "generator/slowdown": float(getattr(self.backend, "slowdown", 1.0)),
                "generator/eval_pinned": self.eval_pinned, "generator/eval_unpinned": self.eval_unpinned,
                **{f"generator/pool/{p}/published": n for p, n in self.published_by_pool.items()},
                **self.backend.metrics()}

    def info(self) -> dict[str, object]:
        return {"boot": self.boot, "backend": self.cfg.backend, "pools": list(self.pools), "shares": dict(self.shares),
                "max_batch_groups": self.cfg.max_batch_groups}


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
            log.warning("slowdown_file_unreadable", path=str(self.path), error=str(exc))
            return
        if factor >= 1.0 and factor != backend.slowdown:
            log.info("slowdown_changed", old=backend.slowdown, new=factor)
            backend.slowdown = factor


async def run(run_cfg: RunSettings, cfg: GeneratorSettings, *, bus: Bus, life: Lifecycle) -> None:
    subjects = Subjects(run_cfg.run)
    train_pools = [p for p in (cfg.pools or run_cfg.pools) if p != run_cfg.eval_pool]
    eval_pools = [run_cfg.eval_pool] if not cfg.pools or run_cfg.eval_pool in cfg.pools else []
    backend: Backend = await asyncio.to_thread(
        BACKENDS.create, cfg.backend, model_path=run_cfg.model_path, dtype=cfg.dtype, deterministic=cfg.deterministic,
        slowdown=cfg.slowdown, vllm=cfg.vllm, mid_sequence_swap=cfg.mid_sequence_swap,
        pin_eval=bool(eval_pools) and cfg.eval_weights == "pinned")
    gen = Generator(backend, cfg, train_pools)
    slowdown = SlowdownFile(cfg.slowdown_file)
    # A version is read through the transport its manifest names (the trainer and weight-broadcast
    # agree on it), so generators need no setting of their own that could disagree.
    transports: dict[str, WeightTransport] = {}
    manifests: dict[int, WeightManifest] = {}  # recent versions, for held-out rounds pinned to one of them

    def transport_for(kind: str) -> WeightTransport:
        if kind not in transports:
            transports[kind] = make_transport(kind, bus=bus, root=run_cfg.run_dir)
        return transports[kind]

    beat = Beat(bus, subjects, "generator", cfg.instance, period=0.5)
    beat.info = gen.info()
    beat.version = backend.version  # the controller holds admission for generators on old weights: say which
    beat.extra = gen.metrics
    wake = asyncio.Event()

    def puller(pool: str):  # type: ignore[no-untyped-def]
        spec = ConsumerSpec(stream="TASKS", durable=subjects.durable("generator", pool),
                            filter_subjects=(subjects.tasks(pool),), ack_wait=TASK_ACK_WAIT, max_deliver=5,
                            max_ack_pending=max(4 * run_cfg.admission_window_groups, 256))
        return bus.puller(spec, Task.decode)

    train_pullers = {p: puller(p) for p in train_pools}
    eval_pullers = {p: puller(p) for p in eval_pools}

    async def follow_weights() -> None:
        async for d in bus.watch(subjects.weights(run_cfg.model_name), deliver="last_per_subject"):
            try:
                manifest = WeightManifest.decode(d.msg)
                manifests[manifest.version] = manifest
                for old in sorted(manifests)[:-32]:
                    del manifests[old]
                if manifest.version <= backend.version:
                    continue
                t0 = time.perf_counter()
                data = await transport_for(manifest.transport).read(manifest.shards[0])
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
                    ctl = Control.decode(d.msg)
                    changed = gen.on_control(ctl)
                except (SchemaError, KeyError, TypeError, ValueError) as exc:
                    await bus.dead_letter(d.subject, d.msg, reason="bad_control",
                                          error=f"{type(exc).__name__}: {exc}")
                    continue
                if changed is not None and ctl.action != "admit":
                    log.info("control_applied", action=ctl.action, seq=ctl.seq, params=ctl.params, reason=ctl.reason)
                beat.info, beat.state = gen.info(), gen.state
                wake.set()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(one(subjects.control_actions("generator", cfg.instance)))
            tg.create_task(one(subjects.control_actions("generator", "all")))

    async def prompts_of(batch: list[Delivery[Task]]) -> list[list[int] | None]:
        """Prompt ids of every task, one environment round trip per environment name in the batch;
        None where the task was handed back (environment unavailable) or refused (dead-lettered)."""
        out: list[list[int] | None] = [None] * len(batch)
        by_env: dict[str, list[int]] = {}
        for i, d in enumerate(batch):
            by_env.setdefault(d.msg.env, []).append(i)

        async def reset(env: str, idx: list[int]) -> None:
            replies: list[EnvReply] = []
            try:
                raw = await bus.request(subjects.env(env, "reset_batch"),
                                        EnvResetBatch(tasks=[batch[i].msg for i in idx]).encode(), timeout=cfg.env_timeout)
                reply = EnvReplyBatch.decode(raw)
                replies = reply.replies
                problem = reply.error or ("" if len(replies) == len(idx) else
                                          f"{len(replies)} replies for {len(idx)} resets")
            except (BusError, SchemaError) as exc:
                problem = str(exc)
            if problem:
                for i in idx:
                    await batch[i].nak(delay=2.0)  # environment service down or restarting: try again later
                log.warning("env_unavailable", tasks=len(idx), env=env, error=problem)
                return
            for i, r in zip(idx, replies, strict=True):
                if r.error:
                    gen.dead += 1
                    await batch[i].term(f"environment refused task {batch[i].msg.task_id!r}: {r.error}")
                else:
                    out[i] = [int(t) for t in r.observation_ids]

        await asyncio.gather(*(reset(env, idx) for env, idx in by_env.items()))
        return out

    async def eval_pins(tasks: list[Task]) -> dict[int, bytes | memoryview | None]:
        """The weights of each held-out version in a batch, for the backend's pinned copy.  A round
        scheduled at a version whose manifest has not arrived yet waits for it a little; one that
        can no longer be read (retention deleted it, or the generator joined after it) runs on the
        live weights, whose tokens record their versions, and is counted as unpinned."""
        pinned_now = backend.pinned_version if isinstance(backend, PinnedSampling) else None
        if pinned_now is None:
            return {}
        pins: dict[int, bytes | memoryview | None] = {}
        for v in sorted({v for t in tasks if (v := gen.eval_version(t)) is not None}):
            if v == pinned_now:
                pins[v] = None
                continue
            deadline = time.monotonic() + 5.0
            while v not in manifests and v > max(manifests, default=-1) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            manifest = manifests.get(v)
            try:
                if manifest is None:
                    raise LookupError("no manifest of that version was seen by this generator")
                pins[v] = await transport_for(manifest.transport).read(manifest.shards[0])
            except (LookupError, BusError, WeightIntegrityError, OSError) as exc:
                log.warning("eval_unpinned", version=v, error=f"{type(exc).__name__}: {exc}",
                            hint="the round runs on the live weights; raise [broadcast].keep_eval_versions")
        return pins

    def train_puller(pool: str):  # type: ignore[no-untyped-def]
        if pool not in train_pullers:  # a pool routed here later: its durable is shared with the other replicas
            train_pullers[pool] = puller(pool)
        return train_pullers[pool]

    async def gather() -> list[tuple[Delivery[Task], bool]]:
        """Eval tasks first (never admitted), then training tasks within the grant, split over the
        routed pools by their shares; room a pool cannot fill goes to the next pools in priority order."""
        got: list[tuple[Delivery[Task], bool]] = []
        if gen.mode == "draining":
            return got
        # A held-out round is hundreds of single greedy samples: take it in one backend call
        # (sized like one training batch in sequences) rather than many small ones, which cost
        # a decode loop each and delay the training batch behind them.
        eval_room = cfg.max_batch_groups * run_cfg.group_size
        for p in eval_pullers.values():
            for d in await p.fetch(eval_room, timeout=0.01):
                got.append((d, True))
        room = min(gen.budget, gen.batch_cap)
        short: set[str] = set()
        for pool, n in gen.split_room(room):
            batch = await train_puller(pool).fetch(n, timeout=0.05)
            gen.note_taken(pool, n)  # a shortfall counts as taken: a dry pool builds no backlog of share
            got.extend((d, False) for d in batch)
            room -= len(batch)
            if len(batch) < n:
                short.add(pool)
        for pool in gen.pools:
            if room <= 0:
                break
            if pool in short:
                continue
            batch = await train_puller(pool).fetch(room, timeout=0.01)
            gen.note_taken(pool, len(batch))
            got.extend((d, False) for d in batch)
            room -= len(batch)
        return got

    async def pool_small_grant() -> None:
        """A batch costs a prefill and max_new_tokens forwards whatever its size, and a grant that
        opens a few groups at a time (top-ups for dropped groups) would otherwise be sampled as
        many small batches. While the room is small, wait up to batch_wait_s for it to grow. Room
        stays small only when this generator is ahead of the trainer, so the wait costs nothing;
        a generator that is behind always finds a large room and never waits."""
        want = min(cfg.min_batch_groups, gen.batch_cap)
        if not 0 < gen.budget < want:
            return
        deadline = time.monotonic() + cfg.batch_wait_s
        while 0 < gen.budget < want and not life.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), timeout=left)
            except TimeoutError:
                return

    async def settle_batch(items: list[tuple[str, bytes, str]], done: list[Delivery[Task]]) -> None:
        """Publish a batch's groups, then ack its tasks, as one step a stop cannot split: a stop
        between the two would leave groups on the bus whose tasks another generator redoes."""
        async def publish_then_ack() -> None:
            await bus.publish_many(items)
            for d in done:
                await d.ack()

        settling = asyncio.create_task(publish_then_ack())
        try:
            await asyncio.shield(settling)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):  # unsettled tasks come back after ack_wait
                await asyncio.wait_for(settling, timeout=life.grace)
            raise

    async def work() -> None:
        while not life.stopping.is_set():
            slowdown.apply(backend)
            beat.state = gen.state
            await pool_small_grant()
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
            gen.redelivered += sum(d.deliveries > 1 for d, _ in deliveries)
            gen.in_flight = len(deliveries)
            batch, kept = [], []
            t_env = time.perf_counter()
            prompts = await prompts_of([d for d, _ in deliveries])
            t_sample = time.perf_counter()
            for (d, is_eval), prompt in zip(deliveries, prompts, strict=True):
                if prompt is None:
                    if not is_eval:
                        gen.started -= 1  # never started: give the slot back
                    continue
                batch.append((d.msg, prompt))
                kept.append((d, is_eval))
            if not batch:
                gen.in_flight = 0
                continue
            try:
                pins = await eval_pins([t for t, _ in batch])
                groups = await asyncio.to_thread(gen.sample, batch, pins)
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
                items.append((subjects.rollouts(d.msg.pool), g.encode(), g.msg_id))
            await settle_batch(items, [d for d, _ in kept])
            gen.note_published(sum(not e for _, e in kept), sum(e for _, e in kept),
                               Counter(d.msg.pool for d, e in kept if not e))
            t_done = time.perf_counter()
            log.debug("batch", train=sum(not e for _, e in kept), eval=sum(e for _, e in kept), version=backend.version,
                      grant=gen.grant_total, started=gen.started, env_s=round(t_sample - t_env, 4),
                      sample_s=round(t_publish - t_sample, 4), publish_s=round(t_done - t_publish, 4))
            gen.in_flight = 0

    beat.state = gen.state
    log.info("generator_ready", backend=cfg.backend, pools=train_pools + eval_pools, boot=gen.boot)
    await run_until_stopped(life, lambda: beat.loop(life), follow_weights, follow_control, work)
