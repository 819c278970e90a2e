"""The episode driver: multi-turn episodes, each at its own pace, on the backend's episode engine.

Every sample of an episodic task is its own episode: one token sequence of policy turns (loss mask
1, behaviour logprob, the version that produced each token) and the observations its environment
answered them with (loss mask 0, logprob 0), appended as ids and never re-tokenised.  The batch
driver hands a task over here once its reset says it is episodic, and goes on taking tasks while
this driver plays it (room permitting): episodes progress independently and a finished group's
room is refilled at once instead of waiting for a whole batch.

Scheduling: one loop alternates engine runs (a few decode steps for every episode that has a turn in
progress, in one batched forward per step, in a worker thread) with the bus work between them.  A
turn that ends goes to its environment as an ``EnvStep`` in its own asyncio task, so episodes waiting
on a slow tool hold nobody else; the observation is appended to the episode's row (only those ids
are prefilled: the engine keeps its KV cache across turns) and its next turn joins the next run.
The engine is only ever called from the loop, between runs, so it needs no locks.

Ends, each a ``Rollout.finish_reason``: the environment says done; ``max_turns``,
``max_total_tokens`` (``Task.limits``) or the model's ``context`` would be passed; a policy
failure (a malformed or unknown tool call: scored); an environment failure or an environment that
does not answer (``env_error``: excluded from the loss, counted, never rewarded 0).  A group is
published when its last episode ends, then its task is acked; a stop hands back the tasks whose
groups are unfinished.

Deterministic mode: the trainer computes an episode whole, in the fixed shapes of its whole length,
so turn-by-turn values cannot be its bits; an episode is recomputed whole when it ends (the ones
that ended since the last run, in one batched call between runs) and claimed exact only if every
policy token came from the weights still in the slot.  Its group settles after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from rlbus.bus.protocol import Bus, BusError
from rlbus.bus.subjects import Subjects
from rlbus.observability import tracing
from rlbus.observability.logging import get_logger
from rlbus.schemas import EnvReply, EnvStep, Rollout, RolloutGroup, SchemaError, Task, spans_from_versions
from rlbus.services.generator.backend import cut_at_stop
from rlbus.services.generator.core import Generator
from rlbus.services.generator.intake import Held
from rlbus.services.generator.publisher import Publisher
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.generator.spans import LoggedSpans
from rlbus.services.generator.status import Status
from rlbus.services.generator.traces import BatchTraces
from rlbus.services.policy.sampler import SampleOut
from rlbus.services.policy.sampling import SamplingParams as PolicySampling
from rlbus.services.runtime.lifecycle import Lifecycle

log = get_logger()


@runtime_checkable
class EpisodeBackend(Protocol):
    """A backend that plays episodes: ``episodes()`` is its engine (the PyTorch backend's
    ``EpisodeEngine`` in services/policy/episodes.py; vLLM's ``SampledTurns`` in turns.py)."""

    def episodes(self) -> Any: ...


@dataclass
class Episode:
    """One sample of a task, played turn by turn: what it holds after its prompt."""

    key: str  # the engine row and the environment's episode id
    index: int
    task: Task
    prompt_len: int
    ids: list[int] = field(default_factory=list)  # policy and observation tokens after the prompt
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    replica: str = ""  # the environment replica holding its state (after the first step)
    tool_s: float = 0.0
    finish_reason: str = ""
    env_error: str = ""
    exact: bool = False  # deterministic mode: the logprobs are the trainer's own for (prompt, completion)
    awaiting_exact: bool = False  # ended; its whole-sequence recompute comes before its group settles

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def length(self) -> int:
        return self.prompt_len + len(self.ids)

    def add_turn(self, turn: Any) -> None:
        self.turns += 1
        self.exact = self.turns == 1 and bool(getattr(turn, "recomputed", False))
        self.ids.extend(int(t) for t in turn.ids)
        self.mask.extend([1] * len(turn.ids))
        self.logprobs.extend(float(x) for x in turn.logprobs)
        self.versions.extend(int(v) for v in turn.versions)

    def policy_version(self) -> int | None:
        """The one version every policy token came from; None when they span a swap (or there are none)."""
        versions = {v for v, m in zip(self.versions, self.mask, strict=True) if m}
        return versions.pop() if len(versions) == 1 else None

    def add_observation(self, ids: list[int]) -> None:
        # Environment tokens carry the version of the turn before them: no version produced them,
        # and the run-length spans stay as short as the turns.
        version = self.versions[-1] if self.versions else 0
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([version] * len(ids))

    def rollout(self, prompt: list[int], text: str, generator_id: str) -> Rollout:
        return Rollout(
            rollout_id=f"{self.task.task_id}:{self.index}", task_id=self.task.task_id, index=self.index,
            token_ids=np.asarray([*prompt, *self.ids], dtype="<i4"), prompt_len=self.prompt_len,
            loss_mask=np.asarray(self.mask, dtype="|u1"), behaviour_logprobs=np.asarray(self.logprobs, dtype="<f4"),
            version_spans=spans_from_versions(np.asarray(self.versions, dtype=np.int64)),
            finish_reason=self.finish_reason, text=text, generator_id=generator_id,
            timings={"tool_s": self.tool_s}, turns=self.turns, env_error=self.env_error,
            exact_logprobs=self.exact and not self.env_error)


@dataclass
class GroupRun:
    """The episodes of one task; published together once the last one ends."""

    held: Held
    prompt: list[int]
    episodes: list[Episode]
    traces: BatchTraces
    episodic: bool = True  # False: a single-turn task played as one-turn episodes (no environment step)
    started: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return all(e.done and not e.awaiting_exact for e in self.episodes)


class EpisodeCounters:
    """What the heartbeat says about episodes."""

    def __init__(self) -> None:
        self.started = 0
        self.ended: Counter[str] = Counter()  # by finish reason
        self.turns = 0
        self.env_steps = 0
        self.tool_s = 0.0
        self.recomputed = 0  # deterministic mode: episodes made exact at their end
        self.recompute_missed = 0  # ... that could not be (a swap came first, a failed recompute)

    def metrics(self, in_flight: int) -> dict[str, float]:
        return {"generator/episodes_in_flight": in_flight, "generator/episodes_started": self.started,
                "generator/episode_turns": self.turns, "generator/episode_env_steps": self.env_steps,
                "generator/episode_tool_s": self.tool_s,
                "generator/episodes_env_error": self.ended["env_error"],
                "generator/episodes_policy_error": self.ended["policy_error"],
                "generator/episodes_recomputed": self.recomputed,
                "generator/episodes_recompute_missed": self.recompute_missed,
                **{f"generator/episodes_ended_{r}": n for r, n in self.ended.items()}}


class EpisodeDriver:
    """Plays episodic tasks handed over by the batch driver (see the module docstring)."""

    STEPS_PER_RUN = 8  # decode steps per engine run: between runs, ended turns go out and new episodes join
    IDLE_WAIT_S = 0.5  # nothing to decode: wait this long for an observation or a new group
    SAMPLING_RETRY_S = 5.0  # an engine failure: the tasks come back after this

    def __init__(self, bus: Bus, subjects: Subjects, gen: Generator, cfg: GeneratorSettings, *,
                 publisher: Publisher, status: Status, life: Lifecycle) -> None:
        self.bus = bus
        self.subjects = subjects
        self.gen = gen
        self.cfg = cfg
        self.publisher = publisher
        self.status = status
        self.life = life
        self.groups: dict[str, GroupRun] = {}  # by task id
        self.counters = EpisodeCounters()
        self._engine: Any = None
        # Engine calls queued for the loop, applied between runs, with the episodes each is for.
        self._ops: list[tuple[list[str], Callable[[Any], None]]] = []
        self._decoding: set[str] = set()  # rows with a turn in progress
        self._exact_pending: list[Episode] = []  # ended, awaiting their whole-sequence recompute
        self._settling: list[GroupRun] = []  # finished groups of the current run, settled together
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self.busy = LoggedSpans("episodes_busy")  # the engine decoding (bench/pipeline_bench.py)
        self._rng = torch.Generator(device="cpu")
        self._rng.manual_seed(zlib.crc32(f"{cfg.seed}/{cfg.instance}/episodes".encode()))

    # --- what the batch driver asks --------------------------------------------------------------
    def supported(self) -> str:
        """Why this generator cannot play episodes ('' when it can)."""
        if isinstance(self.gen.backend, EpisodeBackend):
            return ""
        return (f"the {self.cfg.backend!r} backend does not play multi-turn episodes: serve episodic "
                "environments with [generator] backend = 'torch' or 'vllm'")

    @property
    def tasks_in_flight(self) -> int:
        return len(self.groups)

    def admit(self, held: Held, prompt: list[int], traces: BatchTraces, *, episodic: bool = True) -> None:
        """Play ``held``'s task: ``group_size`` episodes from ``prompt``.  Its grant is already counted
        as started; it is settled (published, acked) or handed back by this driver.  A task that is not
        ``episodic`` (single-turn) ends each episode with its first turn, without an environment step:
        the reward service scores it as it scores the batch path's samples."""
        task = held.task
        tag = f"{self.gen.boot}.{held.delivery.deliveries}"  # a redelivered task opens new episodes
        episodes = [Episode(key=f"{task.task_id}:{k}:{tag}", index=k, task=task, prompt_len=len(prompt))
                    for k in range(task.group_size)]
        if self.gen.eval_version(task) is not None:
            self.gen.eval_unpinned += 1  # episodes play on the live weights; their tokens say which versions
        self.groups[task.task_id] = GroupRun(held, list(prompt), episodes, traces, episodic=episodic)
        self.gen.episode_tasks = len(self.groups)
        self.counters.started += len(episodes)
        keys = [e.key for e in episodes]

        def open_rows(engine: Any) -> None:
            engine.open(keys, list(prompt))
            for key in keys:
                engine.start_turn(key, self._sampling(task), self._stop_ids(), self._turn_tokens(task, len(prompt)),
                                  final=not episodic or task.limits.max_turns == 1)
                self._decoding.add(key)

        self._queue(keys, open_rows)

    # --- the loop --------------------------------------------------------------------------------
    async def loop(self) -> None:
        try:
            while not self.life.stopping.is_set():
                self._apply_ops()
                if self._exact_pending:
                    await self._make_exact()
                if not self._decoding:
                    self.busy.flush()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.IDLE_WAIT_S):
                            await self._wake.wait()
                    continue
                started = time.time()
                try:
                    finished = await asyncio.to_thread(self._run)
                except Exception as exc:  # noqa: BLE001 - a backend failure hands the tasks back, never kills the service
                    await self._hand_back_playing(f"{type(exc).__name__}: {exc}")
                    continue
                self.busy.ran(started, time.time())
                self.status.note_version()  # a version swapped in at the run's start goes out on the heartbeat now
                for key, turn in finished:
                    self._decoding.discard(key)
                    if (ep := self._find(key)) is not None:
                        self._spawn(self._after_turn(ep, turn))
        finally:
            self.busy.flush()
            await self._hand_back_unfinished()

    def _run(self) -> list[tuple[str, Any]]:
        engine = self._engine_now()
        with self.gen.model_lock:
            paced = getattr(self.gen.backend, "paced", None)  # the testing slowdown, as for batch calls
            if paced is None:
                return engine.run(self._rng, max_steps=self.STEPS_PER_RUN)
            return paced(lambda: engine.run(self._rng, max_steps=self.STEPS_PER_RUN))

    def _engine_now(self) -> Any:
        if self._engine is None:
            self._engine = self.gen.backend.episodes()  # type: ignore[attr-defined]
        return self._engine

    def _queue(self, keys: list[str], op: Callable[[Any], None]) -> None:
        self._ops.append((keys, op))
        self._wake.set()

    def _apply_ops(self) -> None:
        ops, self._ops = self._ops, []
        engine = self._engine_now() if ops else None
        for keys, op in ops:
            try:
                op(engine)
            except ValueError as exc:  # ids the engine cannot take (outside the vocabulary): the environment's
                for key in keys:
                    self._decoding.discard(key)
                    if (ep := self._find(key)) is not None and not ep.done:
                        self._spawn(self._end(ep, "env_error", env_error=f"the engine refused the episode's "
                                                                         f"tokens: {exc}"))

    def _sampling(self, task: Task) -> PolicySampling:
        s = task.sampling
        return PolicySampling(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)

    def _stop_ids(self) -> list[int]:
        return [self.gen.backend.eos_id] if self.gen.backend.eos_id is not None else []

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _find(self, key: str) -> Episode | None:
        group = self.groups.get(key.rsplit(":", 2)[0])  # keys are <task id>:<index>:<boot>.<delivery>
        return next((e for e in group.episodes if e.key == key), None) if group is not None else None

    # --- one turn's end --------------------------------------------------------------------------
    async def _after_turn(self, ep: Episode, turn: Any) -> None:
        turn = self._cut_at_stop(ep, turn)
        ep.add_turn(turn)
        self.counters.turns += 1
        if not self.groups[ep.task.task_id].episodic:
            await self._end(ep, turn.finish_reason)
            return
        reply = await self._step(ep, list(turn.ids))
        if reply is None:
            return
        if reply.done:
            if reply.failure == "environment":
                await self._end(ep, "env_error", env_error=reply.observation_text or reply.finish_reason
                                or "the environment reported a failure")
            else:
                await self._end(ep, "policy_error" if reply.failure == "policy" else reply.finish_reason or "done")
            return
        await self._continue(ep, [int(t) for t in reply.observation_ids])

    def _cut_at_stop(self, ep: Episode, turn: Any) -> Any:
        """The turn ends at the first of the task's stop strings (a tool call's closing tag): the
        tokens after it are dropped here and from the engine's row, so the observation follows it."""
        if not ep.task.sampling.stop:
            return turn
        sample = SampleOut(completion_ids=list(turn.ids), behaviour_logprobs=np.asarray(turn.logprobs),
                           token_versions=np.asarray(turn.versions), finish_reason=turn.finish_reason)
        cut = cut_at_stop(sample, ep.task.sampling.stop, self.gen.backend.decode)
        if len(cut.completion_ids) == len(sample.completion_ids):
            return turn
        keep = ep.length + len(cut.completion_ids)
        self._queue([ep.key], lambda engine: engine.truncate(ep.key, keep))
        changes = {"ids": cut.completion_ids, "logprobs": cut.behaviour_logprobs, "versions": cut.token_versions,
                   "finish_reason": "stop"}
        if getattr(turn, "recomputed", False):
            changes["recomputed"] = False  # recomputed in the uncut turn's shapes, not the cut one's: not exact
        return dataclasses.replace(turn, **changes)

    async def _continue(self, ep: Episode, observation: list[int]) -> None:
        """Append the observation and start the next turn, unless a limit ends the episode first."""
        limit, context = self._limits(ep.task)
        if ep.turns >= ep.task.limits.max_turns:
            await self._end(ep, "max_turns")
        elif ep.length + len(observation) + 1 > limit:
            await self._end(ep, "context" if limit == context else "max_total_tokens")
        else:
            ep.add_observation(observation)
            budget = min(ep.task.sampling.max_new_tokens, limit - ep.length)

            def next_turn(engine: Any) -> None:
                engine.append(ep.key, observation)
                # The last turn the limits allow keeps no cache: nothing follows it.
                engine.start_turn(ep.key, self._sampling(ep.task), self._stop_ids(), budget,
                                  final=ep.turns + 1 >= ep.task.limits.max_turns)
                self._decoding.add(ep.key)

            self._queue([ep.key], next_turn)

    async def _step(self, ep: Episode, action: list[int]) -> EnvReply | None:
        """The environment's answer to the turn, or None when the episode ended on a failure to get one
        (an environment failure: excluded from the loss, never rewarded 0)."""
        task = ep.task
        subject = (self.subjects.env_step(task.env, ep.replica) if ep.replica
                   else self.subjects.env(task.env, "step"))
        request = EnvStep(task=task, episode_id=ep.key, action_ids=np.asarray(action, dtype="<i4"),
                          action_text=self.gen.backend.decode(action), turn=ep.turns).encode()
        timeout = self.cfg.env_timeout + max(task.limits.max_tool_s - ep.tool_s, 0.0)
        group = self.groups[task.task_id]
        self.counters.env_steps += 1
        try:
            with group.traces.calls([group.held], f"environment step {task.env}", **{tracing.ENV: task.env}):
                reply = EnvReply.decode(await self.bus.request(subject, request, timeout=timeout))
        except (BusError, SchemaError) as exc:
            await self._end(ep, "env_error", env_error=f"environment {task.env!r} step {ep.turns} failed: {exc}")
            return None
        ep.tool_s += reply.tool_s
        self.counters.tool_s += reply.tool_s
        if reply.error:  # refused: an unknown or expired episode, a replica that restarted
            await self._end(ep, "env_error", env_error=f"environment {task.env!r} refused step {ep.turns}: {reply.error}")
            return None
        ep.replica = reply.replica or ep.replica
        return reply

    def _limits(self, task: Task) -> tuple[int, int]:
        """(the episode's token limit, the model's context); both count the prompt."""
        context = getattr(self.gen.backend, "max_context", None) or (1 << 30)
        mine = task.limits.max_total_tokens
        return (min(mine, context) if mine else context), context

    def _turn_tokens(self, task: Task, length: int) -> int:
        limit, _ = self._limits(task)
        return max(min(task.sampling.max_new_tokens, limit - length), 1)

    # --- ends --------------------------------------------------------------------------------------
    async def _end(self, ep: Episode, reason: str, *, env_error: str = "") -> None:
        ep.finish_reason, ep.env_error = reason, env_error
        self.counters.ended[reason] += 1
        if env_error:
            log.warning("episode_env_error", episode=ep.key, error=env_error)
        self._queue([], lambda engine: engine.close(ep.key))
        if self._wants_exact(ep):
            ep.awaiting_exact = True
            self._exact_pending.append(ep)
            self._wake.set()
            return
        group = self.groups.get(ep.task.task_id)
        if group is not None and group.done:
            await self._settle(group)

    def _wants_exact(self, ep: Episode) -> bool:
        """Deterministic mode, an episode not exact yet (several turns, or a turn cut at a stop
        string) whose policy tokens all come from one version: the trainer computes it whole, in
        the shapes of its whole completion, so only a recompute of the whole sequence can match."""
        engine = self._engine
        return (getattr(engine, "deterministic", False) and not ep.exact and not ep.env_error
                and ep.policy_version() is not None)

    async def _make_exact(self) -> None:
        """The episodes that ended since the last run get the trainer's logprobs of their whole
        sequence, in one batched call; then the groups they complete settle together.  A failure keeps the
        sampled labels (not claimed exact): the groups are published all the same."""
        ended, self._exact_pending = self._exact_pending, []
        mine = [(ep, group) for ep in ended
                if (group := self.groups.get(ep.task.task_id)) is not None and any(e is ep for e in group.episodes)]
        items = [(group.prompt, ep.ids, self._sampling(ep.task), ep.policy_version()) for ep, group in mine]
        engine = self._engine_now()

        def recompute() -> list[Any]:
            with self.gen.model_lock:
                return list(engine.episode_logprobs(items))

        try:
            values = await asyncio.to_thread(recompute)
        except Exception as exc:  # noqa: BLE001 - a failed recompute costs the claim, never the group
            log.warning("episode_recompute_failed", episodes=len(items), error=f"{type(exc).__name__}: {exc}")
            values = [None] * len(items)
        for (ep, _), exact in zip(mine, values, strict=True):
            ep.awaiting_exact = False
            if exact is not None:
                policy = np.asarray(ep.mask) == 1
                ep.logprobs = np.where(policy, exact, 0.0).astype(np.float32).tolist()
                ep.exact = True
                self.counters.recomputed += 1
            else:
                self.counters.recompute_missed += 1
        finished = [group for group in {id(g): g for _, g in mine}.values()
                    if group.done and self.groups.get(group.held.task.task_id) is group]
        if finished:  # in one publish and one round of acks, as the groups of one run settle
            await self._settle_now(finished)

    async def _settle(self, group: GroupRun) -> None:
        """Publish a finished group and ack its task.  The groups that finish in one engine run settle
        together, in one publish and one round of acks as a batch does (one-turn episodes finish a
        whole wave in a run): the first to get here yields once, so the others of its run join it."""
        self._settling.append(group)
        if len(self._settling) > 1:
            return  # the first group of this run settles this one with it
        await asyncio.sleep(0)
        groups, self._settling = self._settling, []
        await self._settle_now(groups)

    async def _settle_now(self, groups: list[GroupRun]) -> None:
        decode = self.gen.backend.decode
        published: list[RolloutGroup] = []
        for group in groups:
            task = group.held.task
            rollouts = [e.rollout(group.prompt, decode(e.ids), self.cfg.instance) for e in group.episodes]
            rg = RolloutGroup(task=task, rollouts=rollouts, sampling=task.sampling, generator_id=self.cfg.instance,
                              created_at=time.time())
            group.traces.sampled(group.held, rg)
            published.append(rg)
        try:
            await self.publisher.settle([g.held for g in groups], published,
                                        traces=[h for g in groups for h in g.traces.headers([g.held])])
        except BusError as exc:  # the server stayed away past publish_outage_s: the tasks come back later
            log.warning("episode_group_unpublished", task_ids=[g.held.task.task_id for g in groups], error=str(exc))
            for group in groups:
                with contextlib.suppress(BusError):
                    await group.held.delivery.nak(delay=self.SAMPLING_RETRY_S, error=f"publishing failed: {exc}")
                self.gen.give_back(int(not group.held.is_eval))
        finally:
            for group in groups:
                group.traces.end()
                self.groups.pop(group.held.task.task_id, None)
            self.gen.episode_tasks = len(self.groups)
            self.status.changed()  # wakes the batch driver: there is room again

    async def _hand_back_unfinished(self) -> None:
        """At a stop: the tasks of unfinished groups come back to the pool at once (their grant too)."""
        for task in list(self._tasks):
            task.cancel()
        await self._hand_back(list(self.groups.values()), "the generator stopped mid-episode", delay=0.0)

    async def _hand_back_playing(self, error: str) -> None:
        """The engine failed: the groups with a turn in progress are handed back for another try (the
        server's max_deliver bounds a task that fails every time), their rows closed."""
        log.warning("episode_engine_failed", error=error, rows=len(self._decoding))
        playing = {ep.task.task_id for key in self._decoding if (ep := self._find(key)) is not None}
        self._decoding.clear()
        await self._hand_back([self.groups[t] for t in playing], f"episode engine failed: {error}",
                              delay=self.SAMPLING_RETRY_S)

    async def _hand_back(self, groups: list[GroupRun], error: str, *, delay: float) -> None:
        for group in groups:
            for ep in group.episodes:
                self._queue([], lambda engine, key=ep.key: engine.close(key))
            with contextlib.suppress(BusError):
                await group.held.delivery.nak(delay=delay, error=error)
            self.gen.give_back(int(not group.held.is_eval))
            group.traces.end()
            self.groups.pop(group.held.task.task_id, None)
        self.gen.episode_tasks = len(self.groups)

    def metrics(self) -> dict[str, float]:
        engine_stats = self._engine.stats if self._engine is not None else {}
        return {**self.counters.metrics(sum(len(g.episodes) for g in self.groups.values())),
                **{f"generator/{k}": float(v) for k, v in engine_stats.items() if k in ("rows",)}}
