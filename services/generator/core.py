"""The generator's I/O-free core: the controller's decisions it holds, and sampling a batch.

``Generator`` keeps what the controller decided for this replica (cumulative admission grant,
freshness floor, pool routing and shares, groups per batch, run state), counts what it started and
published, and turns (task, prompt ids) batches into rollout groups on the backend.  It never
touches the bus: the classes around it (weight follower, control follower, task intake, batch
driver, publisher) do, and a test can drive it with plain objects.
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from collections import Counter, defaultdict
from typing import Any

import numpy as np

from rlbus.observability.logging import get_logger
from rlbus.schemas import (
    Admit,
    AssignPools,
    Concurrency,
    Control,
    Rollout,
    RolloutGroup,
    RunState,
    SamplingParams,
    Task,
    spans_from_versions,
)
from rlbus.schemas.metric_keys import GeneratorKeys
from rlbus.services.generator.backend import Backend, InputLimits, PinnedSampling, cut_at_stop, input_problem
from rlbus.services.generator.settings import GeneratorSettings

log = get_logger()

UNLIMITED = 1 << 62  # the grant with admission off
MODE_OF = {"pause": "paused", "resume": "running", "drain": "draining"}
Pins = dict[int, bytes | memoryview | None]  # held-out version -> its weights (None: the pinned copy holds it)


class Generator:
    """The I/O-free core: turns (task, prompt ids) batches into rollout groups, and keeps the
    controller's decisions (grant, routing, concurrency, run state)."""

    def __init__(self, backend: Backend, cfg: GeneratorSettings, pools: list[str] | None = None) -> None:
        self.backend = backend
        self.cfg = cfg
        # One worker thread at a time uses the model: the batch sampler, the episode engine and the
        # weight follower's swap run in different threads, and a swap during another's forward would mix versions.
        self.model_lock = threading.Lock()
        self.boot = uuid.uuid4().hex[:8]
        # --- the controller's decisions --------------------------------------------------------
        self.grant_total = 0 if cfg.admission else UNLIMITED  # training groups this boot may have started
        self.min_version = 0  # the controller's freshness floor: older weights would yield stale samples
        self.mode = "running"  # running | paused | draining
        self.allowed_pools = list(pools or [])  # training pools this replica may serve (its config)
        self.pools = list(self.allowed_pools)  # in priority order (the controller's routing)
        self.shares: dict[str, float] = {}  # share of starts per pool ({} = first pool with work)
        self.concurrency = cfg.max_batch_groups
        self._seq: dict[str, int] = {}  # last applied seq per kind of decision (pause/resume/drain are one kind)
        self._grant_floor_seq = -1  # admits older than the last drain are void
        self._taken: Counter[str] = Counter()  # groups asked of each pool since the routing changed
        # --- what it did -------------------------------------------------------------------------
        self.started = 0  # training groups started (given back when a task never reached sampling)
        self.published = 0
        self.eval_published = 0
        self.published_by_pool: Counter[str] = Counter()
        self.in_flight = 0  # tasks of the batch being driven now, until handed to the episode driver
        self.episode_tasks = 0  # tasks handed to the episode driver (episodic or one-turn), not settled yet
        self.batches = 0
        self.dead = 0  # tasks and weight versions dead-lettered
        self.redelivered = 0  # tasks received again (another replica died or timed out holding them)
        self.eval_pinned = 0  # held-out groups sampled at exactly their round's version
        self.eval_unpinned = 0  # ... on the live weights, because that version could not be read
        self.weights_refused = 0  # verified versions that do not fit the model (sampling went on without them)
        self.weights_refused_version = -1
        self.weights_refused_why = ""  # the last refusal, for the heartbeat: which version, what does not fit
        self.weights_skipped = 0  # versions deleted by retention before this generator read them
        self._rate_window: list[tuple[float, int]] = []

    # --- state the batch loop and the heartbeat read --------------------------------------------
    @property
    def paused(self) -> bool:
        return self.mode != "running"

    @property
    def state(self) -> str:
        """For the heartbeat: running | paused | draining | drained (nothing held any more)."""
        return "drained" if self.mode == "draining" and self.in_flight + self.episode_tasks == 0 else self.mode

    @property
    def budget(self) -> int:
        """Training groups it may start now."""
        if self.paused or self.backend.version < self.min_version:
            return 0
        return max(self.grant_total - self.started, 0)

    @property
    def batch_cap(self) -> int:
        return max(min(self.cfg.max_batch_groups, self.concurrency), 1)

    @property
    def room(self) -> int:
        """Training groups to take now: the grant's room, less the groups whose episodes are still playing
        (they hold their place in the concurrency cap until they settle)."""
        return max(min(self.budget, self.batch_cap - self.episode_tasks), 0)

    # --- the controller's decisions --------------------------------------------------------------
    def on_control(self, ctl: Control) -> str | None:
        """Apply one decision; returns what changed (for the log), None when it did not apply.

        Decisions of one kind apply in ``seq`` order (a replayed older one is ignored); those that
        carry a ``boot`` apply only to that boot, so a restarted replica ignores its predecessor's."""
        decision = ctl.decision
        kind = decision.KIND  # pause, resume and drain are one kind (RunState): only their order matters
        boot = decision.boot if isinstance(decision, Admit | RunState) else ""
        if (boot and boot != self.boot) or ctl.seq <= self._seq.get(kind, -1):
            return None
        if isinstance(decision, Admit):
            applied = self._admit(ctl.seq, decision)
        elif isinstance(decision, RunState):
            applied = self._run_state(ctl.seq, decision)
        elif isinstance(decision, AssignPools):
            applied = self._assign_pools(decision)
        elif isinstance(decision, Concurrency):
            self.concurrency = max(min(decision.max_groups, self.cfg.max_batch_groups), 1)
            applied = True
        else:  # Evaluate is weight-broadcast's record of a round; SetMix is a request to the controller
            applied = False
        if not applied:
            return None
        self._seq[kind] = ctl.seq
        return f"{ctl.action} {decision}"

    def _admit(self, seq: int, admit: Admit) -> bool:
        if seq < self._grant_floor_seq or not self.cfg.admission:
            return False
        # The newest grant holds, also when lower: the controller takes back unstarted groups from
        # a generator that slowed, and re-grants them only once this heartbeat reports the drop.
        self.grant_total = max(admit.grant_total, self.started)
        self.min_version = max(self.min_version, admit.min_version)
        return True

    def _run_state(self, seq: int, decision: RunState) -> bool:
        if decision.state == "drain":
            # What it has not started goes back to the controller, which re-plans it once the
            # heartbeat says 'draining'; grants issued before this one are void.
            self.grant_total = min(self.grant_total, self.started)
            self._grant_floor_seq = seq
        elif decision.state == "resume" and not self.cfg.admission:
            self.grant_total = UNLIMITED
        self.mode = MODE_OF[decision.state]
        return True

    def _assign_pools(self, decision: AssignPools) -> bool:
        pools = [p for p in decision.pools if p in self.allowed_pools]
        if not pools:
            log.warning("pools_refused", offered=decision.pools, allowed=self.allowed_pools,
                        hint="route this replica to pools of its [generator].pools, or widen them")
            return False
        shares = {p: w for p, w in decision.shares.items() if p in pools and w > 0}
        if (pools, shares) != (self.pools, self.shares):
            self._taken.clear()
        self.pools, self.shares = pools, shares
        return True

    # --- routing ---------------------------------------------------------------------------------
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

    # --- one batch's accounting ------------------------------------------------------------------
    def begin_batch(self, n_train: int, n_tasks: int, redelivered: int) -> None:
        self.started += n_train
        self.redelivered += redelivered
        self.in_flight = n_tasks

    def give_back(self, n_train: int) -> None:
        """Training groups counted as started that never reached sampling: the grant is theirs again."""
        self.started -= n_train

    def end_batch(self) -> None:
        self.in_flight = 0

    def hand_over(self, n_tasks: int) -> None:
        """Tasks of the batch handed to the episode driver: counted in ``episode_tasks`` from now on."""
        self.in_flight = max(self.in_flight - n_tasks, 0)

    def note_published(self, n_train: int, n_eval: int, by_pool: Counter[str] | None = None) -> None:
        self.published += n_train
        self.eval_published += n_eval
        self.published_by_pool.update(by_pool or {})
        now = time.time()
        self._rate_window.append((now, self.published))
        self._rate_window = [(t, c) for t, c in self._rate_window if now - t < 10.0]

    def note_weights_refused(self, version: int, why: str) -> None:
        self.dead += 1
        self.weights_refused += 1
        self.weights_refused_version = version
        self.weights_refused_why = f"v{version}: {why}"[:500]

    # --- sampling --------------------------------------------------------------------------------
    def input_problem(self, task: Task, prompt: list[int]) -> str:
        """Why this task can never be sampled on this model ('' when it can): checked before sampling,
        so it is refused alone instead of failing every task of the batch it landed in."""
        if not isinstance(self.backend, InputLimits):
            return ""
        problem = input_problem(self.backend, prompt, task.sampling.max_new_tokens)
        return f"task {task.task_id!r}: {problem}" if problem else ""

    @staticmethod
    def eval_version(task: Task) -> int | None:
        """The version a held-out task's round was scheduled at (None: not a held-out task)."""
        v = task.metadata.get("eval_version") if task.eval else None
        return int(v) if isinstance(v, int) and v >= 0 else None

    def apply_staged(self) -> bool:
        """Blocking: swap staged weights in now, between other users of the model (the weight follower, as each
        version is staged); True when the version changed."""
        with self.model_lock:
            return self.backend.apply_staged()

    def sample(self, batch: list[tuple[Task, list[int]]], pins: Pins | None = None) -> list[RolloutGroup]:
        """Blocking (run in a worker thread): one backend call per distinct sampling setting and
        pinned version.  ``pins`` holds the weights of each held-out version to sample at exactly
        (None: the backend's pinned copy already holds it); other tasks use the live weights."""
        with self.model_lock:
            return self._sample(batch, pins or {})

    def _sample(self, batch: list[tuple[Task, list[int]]], pins: Pins) -> list[RolloutGroup]:
        by_params: dict[tuple[bytes, int, int | None], list[int]] = defaultdict(list)
        for i, (task, _) in enumerate(batch):
            v = self.eval_version(task)
            by_params[(task.sampling.encode(), task.group_size, v if v in pins else None)].append(i)
        groups: list[RolloutGroup | None] = [None] * len(batch)
        # The version the pinned copy holds (weights None) goes first, before another round's load replaces it.
        held = next((v for v, w in pins.items() if w is None), None)
        calls = sorted(by_params.items(), key=lambda kv: kv[0][2] != held)
        seed = zlib.crc32(f"{self.cfg.seed}/{self.cfg.instance}/{self.batches}".encode())
        stop_ids = [self.backend.eos_id] if self.backend.eos_id is not None else []
        for (_, n, pin), idx in calls:
            sampling = batch[idx[0]][0].sampling
            prompts = [batch[i][1] for i in idx]
            t0 = time.time()
            if pin is not None and isinstance(self.backend, PinnedSampling):
                outs = self.backend.sample_at(pin, pins[pin], prompts, n, sampling, stop_ids, seed)
                self.eval_pinned += len(idx)
            else:
                outs = self.backend.sample(prompts, n, sampling, stop_ids, seed)
                self.eval_unpinned += sum(self.eval_version(batch[i][0]) is not None for i in idx)
            sample_s = time.time() - t0
            for i, samples in zip(idx, outs, strict=True):
                groups[i] = self._group(*batch[i], samples, sampling, sample_s)
        self.batches += 1
        return [g for g in groups if g is not None]

    def _group(self, task: Task, prompt: list[int], samples: list[Any], sampling: SamplingParams,
               sample_s: float) -> RolloutGroup:
        rollouts = []
        for k, s in enumerate(samples):
            # Recomputed values are exact for the completion they were computed on, not a cut of it.
            exact = bool(getattr(s, "exact", False))
            if sampling.stop:
                cut = cut_at_stop(s, sampling.stop, self.backend.decode)
                exact, s = exact and len(cut.completion_ids) == len(s.completion_ids), cut
            ids = np.asarray([*prompt, *s.completion_ids], dtype="<i4")
            rollouts.append(Rollout(
                rollout_id=f"{task.task_id}:{k}", task_id=task.task_id, index=k, token_ids=ids,
                prompt_len=len(prompt), loss_mask=np.ones(len(s.completion_ids), dtype="|u1"),
                behaviour_logprobs=np.asarray(s.behaviour_logprobs, dtype="<f4"),
                version_spans=spans_from_versions(s.token_versions), finish_reason=s.finish_reason,
                text=self.backend.decode(s.completion_ids), generator_id=self.cfg.instance,
                timings={"sample_s": sample_s}, exact_logprobs=exact,
            ))
        return RolloutGroup(task=task, rollouts=rollouts, sampling=sampling, generator_id=self.cfg.instance,
                            created_at=time.time())

    # --- the heartbeat -----------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        rate = 0.0
        if len(self._rate_window) >= 2:
            (t0, c0), (t1, c1) = self._rate_window[0], self._rate_window[-1]
            rate = (c1 - c0) / max(t1 - t0, 1e-6)
        return {GeneratorKeys.GROUPS_STARTED: self.started, GeneratorKeys.GROUPS_PUBLISHED: self.published,
                GeneratorKeys.GRANT_TOTAL: min(self.grant_total, 1 << 40), GeneratorKeys.GROUPS_PER_S: rate,
                GeneratorKeys.CONCURRENCY: self.batch_cap,
                "generator/eval_groups_published": self.eval_published, "generator/in_flight": self.in_flight + self.episode_tasks,
                "generator/dead_lettered": self.dead, "generator/episode_tasks": self.episode_tasks, "generator/paused": float(self.paused),
                "generator/min_version": self.min_version, "generator/tasks_redelivered": self.redelivered,
                "generator/slowdown": float(getattr(self.backend, "slowdown", 1.0)),
                "generator/eval_pinned": self.eval_pinned, "generator/eval_unpinned": self.eval_unpinned,
                "generator/weights_refused": self.weights_refused,
                "generator/weights_refused_version": self.weights_refused_version,
                "generator/weights_skipped": self.weights_skipped,
                **{GeneratorKeys.pool_published(p): n for p, n in self.published_by_pool.items()},
                **self.backend.metrics()}

    def info(self) -> dict[str, object]:
        return {GeneratorKeys.INFO_BOOT: self.boot, "backend": self.cfg.backend,
                GeneratorKeys.INFO_POOLS: list(self.pools), GeneratorKeys.INFO_SHARES: dict(self.shares),
                GeneratorKeys.INFO_MAX_BATCH_GROUPS: self.cfg.max_batch_groups,
                **({"weights_refused": self.weights_refused_why} if self.weights_refused_why else {})}
