"""The batch driver: from the tasks intake took to the groups the publisher settles, one batch at a time.

Per batch: the environments reset every task (one request per environment name), held-out tasks
get their round's pinned weights, the backend samples in a worker thread (new weights swap in
between decode steps), and the publisher publishes the groups and then acks the tasks.  Tasks
that never reach sampling give their grant back; what fails is naked for another try, or
terminated with the reason when it can never succeed.

A bad task costs only itself: one that cannot be addressed or that the model cannot take (prompt
plus max_new_tokens past its context) is refused before sampling, and when the backend raises for
a batch, the batch is bisected so that the task causing it is handed back alone and the others
are published without losing a delivery.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from pathlib import Path

from rlbus.bus.protocol import Bus, BusError
from rlbus.bus.subjects import SubjectError, Subjects
from rlbus.observability import tracing
from rlbus.observability.logging import get_logger
from rlbus.schemas import EnvReplyBatch, EnvResetBatch, RolloutGroup, SchemaError, Task
from rlbus.services.generator.backend import Backend
from rlbus.services.generator.core import Generator, Pins
from rlbus.services.generator.episodes import EpisodeDriver
from rlbus.services.generator.intake import TASK_MAX_DELIVER, Held, TaskIntake
from rlbus.services.generator.publisher import Publisher
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.generator.spans import LoggedSpans
from rlbus.services.generator.status import Status
from rlbus.services.generator.traces import BatchTraces
from rlbus.services.generator.weight_follower import WeightFollower
from rlbus.services.runtime.lifecycle import Lifecycle

log = get_logger()

Prompted = tuple[Held, list[int]]  # a task and the prompt ids its environment rendered


class BatchDriver:
    """Takes a batch from intake, resets, samples and hands the groups to the publisher; repeats."""

    ENV_RETRY_S = 2.0  # environment service down or restarting: first retry of the held batch after this
    ENV_RETRY_MAX_S = 10.0  # the retries back off up to this
    ENV_OUTAGE_S = 120.0  # then the batch is naked (comes back after ENV_RETRY_S) and the next one tried
    SAMPLING_RETRY_S = 5.0  # a backend failure: the tasks come back after this (max_deliver bounds it)
    IDLE_WAIT_S = 0.1  # nothing to take: look again after this, or as soon as a decision or weights arrive

    def __init__(self, bus: Bus, subjects: Subjects, gen: Generator, cfg: GeneratorSettings, *, intake: TaskIntake,
                 weights: WeightFollower, publisher: Publisher, status: Status, life: Lifecycle,
                 slowdown: SlowdownFile, episodes: EpisodeDriver) -> None:
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
        self.episodes = episodes
        self.traces = BatchTraces([])  # the spans of the batch being driven, in each task's trace
        self._episodic: set[int] = set()  # id() of the batch's tasks whose reset said they are episodic
        self._waited: dict[str, float] = {}  # when the batch's loop turn began, its grant wait and take
        # Loop turns that took nothing, by why (bench/pipeline_bench.py lays the trainer's waits over them):
        # the admission grant used up, the concurrency cap full (groups still playing), or no task queued.
        self._took_nothing = {why: LoggedSpans(f"generator_{why}") for why in ("no_grant", "cap_full", "no_tasks")}

    async def loop(self) -> None:
        while not self.life.stopping.is_set():
            self.slowdown.apply(self.gen.backend)
            self.status.show()
            started, t0 = time.time(), time.perf_counter()
            await self.intake.wait_for_fuller_grant(self.cfg.min_batch_groups, self.cfg.batch_wait_s)
            t_take = time.perf_counter()
            why = "no_tasks" if self.gen.room else "no_grant" if not self.gen.budget else "cap_full"
            held = await self.intake.take()
            if held:
                self._waited = {"started": round(started, 4), "grant_wait_s": round(t_take - t0, 4),
                                "take_s": round(time.perf_counter() - t_take, 4)}
                await self.drive(held)
            else:  # staged weights need no swap here: the weight follower swaps them in as they arrive
                await self.status.wait_for_change(self.IDLE_WAIT_S)
                self._took_nothing[why].ran(started, time.time())
        for spans in self._took_nothing.values():
            spans.flush()

    async def drive(self, held: list[Held]) -> None:
        """One batch, from reset to settled (or handed back).  A task that can never be sampled here
        (a pool or environment name that is no subject, a prompt the model cannot take) is refused
        alone before sampling; the others go on without it."""
        n_train = sum(not h.is_eval for h in held)
        self.gen.begin_batch(n_train, len(held), redelivered=sum(h.delivery.deliveries > 1 for h in held))
        self.traces = BatchTraces(held, generator_id=self.gen.cfg.instance)
        try:
            held = await self._addressable(held)
            t_env = time.perf_counter()
            ready = await self._hand_over_episodes(await self._screen(await self._reset(held)))
            if not ready:
                return
            t_sample = time.perf_counter()
            with self.traces.calls([h for h, _ in ready], "sample", **{tracing.BATCH_GROUPS: len(ready)}):
                sampled = await self._sample(ready)
            if not sampled:
                return
            self.status.show()
            t_publish = time.perf_counter()
            for h, g in sampled:
                self.traces.sampled(h, g)
            await self.publisher.settle([h for h, _ in sampled], [g for _, g in sampled],
                                        traces=self.traces.headers([h for h, _ in sampled]))
            n_eval = sum(h.is_eval for h, _ in sampled)
            # One line a batch: `bench/pipeline_bench.py` lines these up with the trainer's waits.
            log.info("batch", train=len(sampled) - n_eval, eval=n_eval, version=self.gen.backend.version,
                     **self._waited, env_s=round(t_sample - t_env, 4), sample_s=round(t_publish - t_sample, 4),
                     publish_s=round(time.perf_counter() - t_publish, 4))
        finally:
            self.traces.end()
            self._episodic.clear()
            self.gen.end_batch()

    # --- tasks refused alone -----------------------------------------------------------------------
    async def _addressable(self, held: list[Held]) -> list[Held]:
        """The tasks whose pool and environment name subjects.  Task decoding refuses other names,
        but a name that got here any other way must cost its task, never the generator (publishing
        the group would raise, and kill each replica that takes the task in turn)."""
        keep: list[Held] = []
        for h in held:
            try:
                self.subjects.rollouts(h.task.pool)
                self.subjects.env(h.task.env, "reset_batch")
            except SubjectError as exc:
                await self._refuse([h], f"task {h.task.task_id!r} cannot be addressed: {exc}")
                self.gen.give_back(int(not h.is_eval))
            else:
                keep.append(h)
        return keep

    async def _screen(self, ready: list[Prompted]) -> list[Prompted]:
        """The tasks the model can take.  One whose prompt plus max_new_tokens exceeds the model's
        context (or whose prompt is empty or outside the vocabulary) would fail the whole backend
        call it lands in, every time: it is refused alone, before sampling."""
        keep: list[Prompted] = []
        for h, prompt in ready:
            problem = self.gen.input_problem(h.task, prompt)
            if problem:
                await self._refuse([h], problem)
                self.gen.give_back(int(not h.is_eval))
            else:
                keep.append((h, prompt))
        return keep

    async def _hand_over_episodes(self, ready: list[Prompted]) -> list[Prompted]:
        """The tasks this driver samples; the others go to the episode driver, which plays and settles
        them while this driver takes the next batch: the episodic ones (or they are refused, when this
        backend cannot play them), and with ``single_turn = "episodes"`` the single-turn training tasks
        too, as one-turn episodes."""
        keep: list[Prompted] = []
        for h, prompt in ready:
            episodic = id(h) in self._episodic
            if not episodic and not self._one_turn_episode(h):
                keep.append((h, prompt))
            elif episodic and (problem := self.episodes.supported()):
                await self._refuse([h], f"task {h.task.task_id!r} is episodic: {problem}")
                self.gen.give_back(int(not h.is_eval))
            else:
                self.traces.outcome(h, "episodes")
                self.episodes.admit(h, prompt, self.traces.detach(h), episodic=episodic)
                self.gen.hand_over(1)
        return keep

    def _one_turn_episode(self, h: Held) -> bool:
        # Held-out tasks stay here: the batch path samples them on their round's pinned weights.  So do
        # all tasks while a drafter is on (the speculative tail is the batch sampler's) and, unless
        # single_turn is set, in deterministic mode (`GeneratorSettings.single_turn_episodes`).  The vLLM
        # backend's batch call is already continuously batched inside vLLM (its episode runs last
        # until their longest turn ends, so one-turn episodes would gain nothing there).
        return self.cfg.single_turn_episodes and not h.is_eval and not self.episodes.supported()

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
        with self.traces.calls(held, f"environment reset_batch {env}", **{tracing.ENV: env}):
            reply, problem = await self._request_resets(subject, env, held)
        if reply is None:
            for h in held:  # the error goes with the nak: a max-deliveries dead letter then says what failed
                self.traces.outcome(h, "env_unavailable", problem)
                await h.delivery.nak(delay=self.ENV_RETRY_S, error=f"environment {env!r} unavailable: {problem}")
            log.warning("env_unavailable", tasks=len(held), env=env, error=problem)
            return [None] * len(held)
        prompts: list[list[int] | None] = []
        for h, r in zip(held, reply.replies, strict=True):
            if r.error:
                await self._refuse([h], f"environment refused task {h.task.task_id!r}: {r.error}")
                prompts.append(None)
            else:
                prompts.append([int(t) for t in r.observation_ids])
                if r.episodic:
                    self._episodic.add(id(h))
        return prompts

    async def _request_resets(self, subject: str, env: str, held: list[Held]) -> tuple[EnvReplyBatch | None, str]:
        """The environment's replies, or (None, why).  While it is unreachable (no responders, no reply
        in time: a restart), the batch stays held and the same request is retried with backoff, up to
        ``ENV_OUTAGE_S``: naking it would have the intake take the next tasks at once and cycle the
        whole backlog through the outage, each cycle a delivery, until max_deliver dead-letters them."""
        request = EnvResetBatch(tasks=[h.task for h in held]).encode()
        deadline = time.monotonic() + self.ENV_OUTAGE_S
        delay = self.ENV_RETRY_S
        while True:
            try:
                reply = EnvReplyBatch.decode(await self.bus.request(subject, request, timeout=self.cfg.env_timeout))
            except SchemaError as exc:
                return None, str(exc)
            except BusError as exc:  # unreachable: wait for it, holding the tasks (in_progress keeps them ours)
                if time.monotonic() + delay > deadline:
                    return None, f"{exc} (for {self.ENV_OUTAGE_S:.0f}s)"
                log.warning("env_unreachable_holding_batch", tasks=len(held), env=env, error=str(exc), retry_s=delay)
                if await self.life.sleep(delay):
                    return None, "stopping"
                delay = min(delay * 2, self.ENV_RETRY_MAX_S)
                continue
            problem = reply.error or ("" if len(reply.replies) == len(held) else
                                      f"{len(reply.replies)} replies for {len(held)} resets")
            return (None, problem) if problem else (reply, "")

    async def _refuse(self, held: list[Held], reason: str) -> None:
        """Tasks that can never succeed here: terminated and dead-lettered with the reason."""
        for h in held:
            self.gen.dead += 1
            self.traces.outcome(h, "refused", reason)
            log.warning("task_refused", task_id=h.task.task_id, pool=h.task.pool, reason=reason)
            await h.delivery.term(reason)

    # --- sampling ----------------------------------------------------------------------------------
    async def _sample(self, ready: list[Prompted]) -> list[tuple[Held, RolloutGroup]]:
        """The tasks that sampled, with their groups.  When the backend fails,
        the failure is traced to the tasks that cause it (``_bisect``) so that the others are
        published anyway and pay no delivery for it; tasks that failed are handed back."""
        try:
            pins = await self.weights.pins_for([h.task for h, _ in ready])
        except Exception as exc:  # noqa: BLE001 - held-out rounds then run on the live weights
            log.warning("eval_unpinned", error=repr(exc), hint="the round runs on the live weights")
            pins = {}
        groups, error = await self._try(ready, pins)
        if groups is not None:
            return [(h, g) for (h, _), g in zip(ready, groups, strict=True)]
        done: list[tuple[Held, RolloutGroup]] = []
        if len(ready) == 1:
            await self._hand_back(ready, error, alone=False)
        else:
            await self._bisect(ready, error, pins, done)
        return done

    async def _try(self, part: list[Prompted], pins: Pins) -> tuple[list[RolloutGroup] | None, str]:
        """(groups, '') or (None, the error): a backend failure must not kill the service or lose tasks."""
        try:
            return await self._play([(h.task, p) for h, p in part], pins), ""
        except Exception as exc:  # noqa: BLE001 - any backend error: the tasks are handed back, not lost
            log.warning("sampling_failed", tasks=len(part), error=repr(exc))
            return None, f"{type(exc).__name__}: {exc}"

    async def _bisect(self, part: list[Prompted], error: str, pins: Pins, done: list[tuple[Held, RolloutGroup]]) -> None:
        """``part`` failed with ``error``: sample each half.  Both failing says the backend fails
        whatever the input: every task of ``part`` is handed back.  One failing puts the cause in
        that half: bisect it.  A single task failing beside a half that sampled is the cause.
        At most 2·log2(n) more backend calls, and the halves that sample are kept."""
        if len(part) == 1:
            await self._hand_back(part, error, alone=True)
            return
        halves = (part[: len(part) // 2], part[len(part) // 2 :])
        tries = [await self._try(half, pins) for half in halves]
        failed = [(half, err) for half, (groups, err) in zip(halves, tries, strict=True) if groups is None]
        for half, (groups, _) in zip(halves, tries, strict=True):
            if groups is not None:
                done.extend((h, g) for (h, _), g in zip(half, groups, strict=True))
        if len(failed) == 2:
            await self._hand_back(part, error, alone=False)
        elif failed:
            await self._bisect(*failed[0], pins, done)

    async def _hand_back(self, part: list[Prompted], error: str, *, alone: bool) -> None:
        """Tasks that failed sampling: naked for another try (their grant given back), or, on their
        last allowed delivery, terminated with the error so the dead letter says what failed."""
        for h, _ in part:
            n = h.delivery.deliveries
            if n >= TASK_MAX_DELIVER:
                beside = " while the tasks beside it sampled" if alone else ""
                await self._refuse([h], f"task {h.task.task_id!r} failed sampling on delivery {n} of "
                                        f"{TASK_MAX_DELIVER}{beside}: {error}")
            else:
                self.traces.outcome(h, "handed_back", error)
                await h.delivery.nak(delay=self.SAMPLING_RETRY_S, error=f"sampling failed on delivery {n}: {error}")
        self.gen.give_back(sum(not h.is_eval for h, _ in part))

    async def _play(self, batch: list[tuple[Task, list[int]]], pins: Pins) -> list[RolloutGroup]:
        """Sample the batch's single-turn tasks (one completion ends each; episodic tasks went to the
        episode driver)."""
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
