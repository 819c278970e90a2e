"""The generator's episode driver on the in-memory bus, with a fake engine and a fake episodic environment.

What a user cares about: a multi-turn episode is one token sequence (policy turns with loss mask 1,
their logprobs and versions; observations with mask 0 and logprob 0, appended as the environment's
ids, never re-tokenised); an episode's later steps reach the environment replica that holds it;
every limit ends the episode with its own finish reason; an environment failure (a failure reply, a
replica gone, an unknown episode) is recorded as ``env_error`` so the trainer excludes it, while a
policy failure is scored; the group is published before its task is acked; and a backend that cannot
play episodes refuses an episodic task with the reason instead of failing.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlbus.schemas import EnvReply, EnvReplyBatch, EnvResetBatch, EnvStep, EpisodeLimits, SamplingParams, Task
from tests.unit.test_generator_intake import RUN, FakeBackend, Harness, eventually

PROMPT = [1, 2, 3]
OBSERVATION = [9, 9]
TURN = [5, 6]


@dataclass
class Turn:
    """One finished turn, as the engine returns it (``rlbus.services.policy.episodes.Turn``'s fields)."""

    ids: list[int]
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str


class FakeEngine:
    """Each turn in progress ends at the next run with two tokens of the backend's live version."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self.rows: dict[str, list[int]] = {}
        self.turns: dict[str, int] = {}  # rows with a turn in progress -> its max_new_tokens
        self.appended: list[tuple[str, list[int]]] = []
        self.truncated: list[tuple[str, int]] = []
        self.closed: list[str] = []
        self.failures = 0  # runs that raise, as a backend that fell over would
        self.finals: list[bool] = []  # start_turn's final flag, per call

    def open(self, keys: list[str], prompt_ids: list[int]) -> None:
        for key in keys:
            self.rows[key] = list(prompt_ids)

    def append(self, key: str, ids: list[int]) -> None:
        if any(t >= 100 for t in ids):
            raise ValueError(f"observation id {max(ids)} is outside the vocabulary (size 100)")
        self.appended.append((key, list(ids)))
        self.rows[key].extend(ids)

    def start_turn(self, key: str, params: Any, stop_ids: list[int], max_new_tokens: int, *,
                   final: bool = False) -> None:
        self.turns[key] = max_new_tokens
        self.finals.append(final)

    def run(self, generator: Any, max_steps: int = 16) -> list[tuple[str, Turn]]:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("the accelerator fell over")
        out = []
        for key, budget in self.turns.items():
            ids = TURN[:budget]
            self.rows[key].extend(ids)
            out.append((key, Turn(ids=list(ids), logprobs=np.full(len(ids), -0.5, np.float32),
                                  versions=np.full(len(ids), self.backend.version, np.int64), finish_reason="length")))
        self.turns.clear()
        return out

    def truncate(self, key: str, length: int) -> None:
        self.truncated.append((key, length))
        del self.rows[key][length:]

    def close(self, key: str) -> None:
        self.closed.append(key)
        self.rows.pop(key, None)
        self.turns.pop(key, None)

    @property
    def stats(self) -> dict[str, float]:
        return {"rows": len(self.rows)}


class EpisodeBackend(FakeBackend):
    max_context = 64

    def __init__(self) -> None:
        super().__init__()
        self.engine = FakeEngine(self)

    def episodes(self) -> FakeEngine:
        return self.engine


class EpisodicEnv:
    """Episodic for every task: the first step opens the episode on replica 'env-a', which holds it;
    ``answer_on`` is the turn whose step ends it ('done'), ``reply`` overrides a step's answer."""

    def __init__(self, h: Harness, *, answer_on: int = 2, reply: dict[str, Any] | None = None) -> None:
        self.h = h
        self.answer_on = answer_on
        self.reply = reply or {}
        self.steps: list[tuple[str, int, str]] = []  # (which subject, turn, episode id)
        self.held: set[str] = set()
        self.forget = False  # a replica that restarted: it holds none of the episodes it opened

    async def start(self, *, serve_replica: bool = True) -> None:
        s = self.h.s
        await self.h.bus.serve(s.env_any("reset_batch"), self.reset_batch, queue="environment")
        await self.h.bus.serve(s.env_any("step"), lambda d: self.step(d, "queue"), queue="environment")
        if serve_replica:
            await self.h.bus.serve(s.env_step_of("env-a"), lambda d: self.step(d, "replica"), queue="env-a")

    async def reset_batch(self, data: bytes) -> bytes:
        return EnvReplyBatch(replies=[EnvReply(episode_id=t.task_id, observation_ids=np.array(PROMPT, "<i4"),
                                               episodic=True) for t in EnvResetBatch.decode(data).tasks]).encode()

    async def step(self, data: bytes, via: str) -> bytes:
        req = EnvStep.decode(data)
        self.steps.append((via, req.turn, req.episode_id))
        if req.turn > 1 and req.episode_id not in self.held:
            return EnvReply(episode_id=req.episode_id, error=f"episode {req.episode_id!r} is unknown here").encode()
        if not self.forget:
            self.held.add(req.episode_id)
        if req.turn in self.reply:
            return EnvReply(episode_id=req.episode_id, replica="env-a", **self.reply[req.turn]).encode()
        if req.turn >= self.answer_on:
            return EnvReply(episode_id=req.episode_id, replica="env-a", done=True, finish_reason="done").encode()
        return EnvReply(episode_id=req.episode_id, replica="env-a", observation_ids=np.array(OBSERVATION, "<i4"),
                        tool_s=0.25).encode()


async def episodic_task(h: Harness, task_id: str = "ep-0", *, stop: tuple[str, ...] = (), **limits: Any) -> Task:
    t = Task(run=RUN, task_id=task_id, pool="train", env="calculator", prompt="1+2+3+4=", answer="10", group_size=2,
             sampling=SamplingParams(max_new_tokens=2, stop=list(stop)), limits=EpisodeLimits(**limits))
    await h.bus.publish(h.s.tasks("train"), t.encode(), msg_id=t.msg_id)
    return t


async def played(h: Harness, n: int = 1) -> None:
    await h.admit(n)
    await eventually(lambda: len(h.groups()) == n, what=f"{n} episodic group(s) published")
    await eventually(lambda: h.waiting("train") == 0, what="the task acked after its group")


async def test_a_two_turn_episode_is_one_token_sequence(tmp_path: Path) -> None:
    backend = EpisodeBackend()
    async with Harness(tmp_path, backend=backend, env=False) as h:
        env = EpisodicEnv(h)
        await env.start()
        await episodic_task(h)
        await played(h)
        (group,) = h.groups()
        assert len(group.rollouts) == 2
        for r in group.rollouts:
            assert r.token_ids.tolist() == PROMPT + TURN + OBSERVATION + TURN
            assert r.prompt_len == len(PROMPT)
            assert r.loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
            assert r.behaviour_logprobs.tolist() == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
            assert r.token_versions().tolist() == [0] * 6
            assert (r.turns, r.finish_reason, r.env_error) == (2, "done", "")
            assert r.timings["tool_s"] == 0.25
        # Each episode's first step went to the queue group, its second to the replica holding it.
        assert sorted((via, turn) for via, turn, _ in env.steps) == [("queue", 1), ("queue", 1),
                                                                      ("replica", 2), ("replica", 2)]
        # The observation reached the engine as ids (KV extended, nothing re-tokenised); rows closed.
        assert [ids for _, ids in backend.engine.appended] == [OBSERVATION, OBSERVATION]
        assert sorted(backend.engine.closed) == sorted({ep for _, _, ep in env.steps})
        assert all(held for _, _, held in h.bus.settles), "published while its task was still held"
        await eventually(lambda: h.metric("generator/episodes_ended_done") == 2, what="episode counters")
        assert h.metric("generator/episode_tasks") == 0


async def test_a_stop_string_ends_the_turn_and_the_observation_follows_it(tmp_path: Path) -> None:
    backend = EpisodeBackend()
    async with Harness(tmp_path, backend=backend, env=False) as h:
        await EpisodicEnv(h).start()
        await episodic_task(h, stop=("5",))  # the fake decodes id 5 as '5': each turn ends after its first token
        await played(h)
        for r in h.groups()[0].rollouts:
            assert r.token_ids.tolist() == PROMPT + [5] + OBSERVATION + [5]
            assert r.loss_mask.tolist() == [1, 0, 0, 1]
        # The engine's rows were cut back to the stop before the observation was appended.
        assert sorted(length for _, length in backend.engine.truncated) == [4, 4, 7, 7]


async def test_limits_end_episodes_with_their_reason(tmp_path: Path) -> None:
    async with Harness(tmp_path, backend=EpisodeBackend(), env=False) as h:
        await EpisodicEnv(h, answer_on=99).start()
        await episodic_task(h, "turns", max_turns=3)
        await episodic_task(h, "tokens", max_total_tokens=len(PROMPT) + 2 * len(TURN) + len(OBSERVATION))
        await played(h, 2)
        by_task = {g.task.task_id: g.rollouts for g in h.groups()}
        assert {r.finish_reason for r in by_task["turns"]} == {"max_turns"}
        assert {r.turns for r in by_task["turns"]} == {3}
        assert h.backend.engine.finals.count(True) == 2, "the third turn of each 'turns' episode is its last"
        # Room for two turns and one observation: the second observation would pass the limit.
        assert {r.finish_reason for r in by_task["tokens"]} == {"max_total_tokens"}
        assert {len(r.token_ids) for r in by_task["tokens"]} == {len(PROMPT) + 2 * len(TURN) + len(OBSERVATION)}


async def test_the_models_context_ends_an_episode(tmp_path: Path) -> None:
    backend = EpisodeBackend()
    backend.max_context = len(PROMPT) + len(TURN) + 1  # no room for the observation
    async with Harness(tmp_path, backend=backend, env=False) as h:
        await EpisodicEnv(h).start()
        await episodic_task(h)
        await played(h)
        assert {r.finish_reason for r in h.groups()[0].rollouts} == {"context"}


async def test_environment_failures_are_recorded_not_scored_and_policy_failures_are_scored(tmp_path: Path) -> None:
    async with Harness(tmp_path, backend=EpisodeBackend(), env=False) as h:
        env = EpisodicEnv(h, reply={1: {"done": True, "failure": "environment", "finish_reason": "env_error",
                                        "observation_text": "the tool's process died"}})
        await env.start()
        await episodic_task(h, "envfail")
        await played(h)
        env.reply = {1: {"done": True, "failure": "policy", "finish_reason": "policy_error",
                         "observation_text": "unknown tool 'calc2'"}}
        await episodic_task(h, "policyfail")
        await played(h, 2)
        by_task = {g.task.task_id: g.rollouts for g in h.groups()}
        assert {(r.finish_reason, r.env_error) for r in by_task["envfail"]} == {("env_error", "the tool's process died")}
        assert {(r.finish_reason, r.env_error) for r in by_task["policyfail"]} == {("policy_error", "")}


async def test_a_replica_gone_or_an_unknown_episode_ends_it_as_an_environment_failure(tmp_path: Path) -> None:
    async with Harness(tmp_path, backend=EpisodeBackend(), env=False) as h:
        env = EpisodicEnv(h)
        await env.start(serve_replica=False)  # the replica that holds the episodes is gone
        await episodic_task(h, "gone")
        await played(h)
        (group,) = h.groups()
        assert {r.finish_reason for r in group.rollouts} == {"env_error"}
        assert all("step 2 failed" in r.env_error and "no responders" in r.env_error for r in group.rollouts)
        assert {r.turns for r in group.rollouts} == {2}
        await eventually(lambda: h.metric("generator/episodes_env_error") == 2, what="env errors counted")
        env.forget = True  # a replica back from a restart: it does not know the episodes
        await h.bus.serve(h.s.env_step_of("env-a"), lambda d: env.step(d, "replica"), queue="env-a")
        await episodic_task(h, "forgotten")
        await played(h, 2)
        rollouts = {g.task.task_id: g.rollouts for g in h.groups()}["forgotten"]
        assert {r.finish_reason for r in rollouts} == {"env_error"}
        assert all("refused step 2" in r.env_error and "unknown here" in r.env_error for r in rollouts)


async def test_a_backend_without_episodes_refuses_episodic_tasks_with_the_reason(tmp_path: Path) -> None:
    async with Harness(tmp_path, env=False) as h:  # FakeBackend has no episode engine
        await EpisodicEnv(h).start()
        await episodic_task(h)
        await h.admit(1)
        await eventually(lambda: len(h.bus.messages("DEAD")) == 1, what="the episodic task dead-lettered")
        [letter] = h.bus.dead_letters
        assert "is episodic" in letter.reason and "does not play multi-turn episodes" in letter.reason
        assert h.groups() == []


async def test_an_engine_failure_hands_the_task_back_and_it_plays_again(tmp_path: Path) -> None:
    backend = EpisodeBackend()
    backend.engine.failures = 1
    async with Harness(tmp_path, backend=backend, env=False) as h:
        await EpisodicEnv(h).start()
        await episodic_task(h)
        await h.admit(1)
        # Handed back with a delay, then taken again (the grant given back) and played to its end.
        await eventually(lambda: len(h.groups()) == 1, timeout=20, what="the group after a retry")
        assert {r.finish_reason for r in h.groups()[0].rollouts} == {"done"}
        assert h.bus.dead_letters == []


async def test_observation_ids_the_model_cannot_take_end_the_episode_as_an_environment_failure(tmp_path: Path) -> None:
    async with Harness(tmp_path, backend=EpisodeBackend(), env=False) as h:
        env = EpisodicEnv(h)
        env.reply = {1: {"observation_ids": np.array([500], "<i4")}}
        await env.start()
        await episodic_task(h)
        await played(h)
        for r in h.groups()[0].rollouts:
            assert r.finish_reason == "env_error" and "outside the vocabulary" in r.env_error


class SampledTurnsBackend(FakeBackend):
    """A backend without an engine of its own: episodes through ``SampledTurns`` (the vLLM path)."""

    max_context = 64
    vocab_size = 100

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[int]] = []

    def sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        self.prompts.extend(list(p) for p in prompts)
        return super().sample(prompts, n, sampling, stop_ids, seed)

    def episodes(self) -> Any:
        from rlbus.services.generator.turns import SampledTurns

        if not hasattr(self, "_turns"):
            self._turns = SampledTurns(self)
        return self._turns


async def test_a_backend_that_batches_by_itself_plays_episodes_through_sampled_turns(tmp_path: Path) -> None:
    backend = SampledTurnsBackend()
    async with Harness(tmp_path, backend=backend, env=False) as h:
        await EpisodicEnv(h).start()
        await episodic_task(h)
        await played(h)
        sampled = [7, 8]  # FakeBackend's two tokens
        for r in h.groups()[0].rollouts:
            assert r.token_ids.tolist() == PROMPT + sampled + OBSERVATION + sampled
            assert r.loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
            assert r.behaviour_logprobs.tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.1, -0.2])
            assert (r.turns, r.finish_reason) == (2, "done")
        # Each turn's prompt is the row's ids so far: the observation appended, nothing re-tokenised.
        assert sorted(map(tuple, backend.prompts)) == sorted(
            [tuple(PROMPT)] * 2 + [tuple(PROMPT + sampled + OBSERVATION)] * 2)


async def test_single_turn_tasks_play_as_one_turn_episodes_and_held_out_ones_stay_on_the_batch_path(
        tmp_path: Path) -> None:
    backend = EpisodeBackend()
    async with Harness(tmp_path, backend=backend, pools=("train", "eval")) as h:  # single_turn's default
        steps: list[bytes] = []

        async def step(data: bytes) -> bytes:
            steps.append(data)
            return EnvReply(episode_id="?", error="single-turn tasks take no step").encode()

        await h.bus.serve(h.s.env_any("step"), step, queue="environment")
        await h.tasks("train", 3)
        await h.tasks("eval", 2, evaluate=True)
        await h.admit(3)
        await eventually(lambda: h.published() == Counter(train=3, eval=2), what="every group published")
        await eventually(lambda: h.waiting("train") == 0 and h.waiting("eval") == 0, what="every task acked")
        by_pool = {g.task.pool: g for g in h.groups()}
        # Training tasks: one turn each on the engine (its tokens), no environment step, row closed.
        for r in by_pool["train"].rollouts:
            assert r.token_ids.tolist() == PROMPT + TURN
            assert r.loss_mask.tolist() == [1, 1] and r.behaviour_logprobs.tolist() == [-0.5, -0.5]
            assert (r.turns, r.finish_reason, r.env_error) == (1, "length", "")
        assert backend.engine.finals == [True] * 6, "a one-turn episode keeps no KV for a next turn"
        assert len(backend.engine.closed) == 6 and not backend.engine.rows
        assert not steps, "no environment step for a single-turn task"
        # Held-out tasks: the batch sampler's tokens ([7, 8]), so they ran on the pinned path.
        assert {tuple(r.token_ids.tolist()) for r in by_pool["eval"].rollouts} == {(1, 2, 3, 7, 8)}
        assert backend.calls == [2]


@pytest.mark.parametrize("gen", [{"single_turn": "batch"}, {"speculative": {"drafter": "group"}}, {"deterministic": True}],
                         ids=["batch", "drafter-on", "deterministic"])
async def test_single_turn_tasks_stay_on_the_batch_sampler_when_asked_or_while_a_drafter_is_on(
        tmp_path: Path, gen: dict[str, Any]) -> None:
    # The speculative tail drafts inside the batch sampler only: with a drafter on, single_turn's
    # default ("episodes") must not take the tasks away from it; nor in deterministic mode, where the
    # batch sampler decodes the trainer's exact log-probs and the episode engine would recompute them.
    backend = EpisodeBackend()
    async with Harness(tmp_path, backend=backend, **gen) as h:
        await h.tasks("train", 3)
        await h.admit(3)
        await eventually(lambda: h.published() == Counter(train=3), what="every group published")
        assert {tuple(r.token_ids.tolist()) for g in h.groups() for r in g.rollouts} == {(1, 2, 3, 7, 8)}
        assert sum(backend.calls) == 3 and not backend.engine.finals, "no row on the episode engine"


async def test_groups_that_finish_in_one_engine_run_settle_in_one_publish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One-turn episodes end a whole wave in one run: settling each group alone cost a publish round
    # trip and an ack round per group while the concurrency cap stayed full.
    from rlbus.services.generator.publisher import Publisher

    sizes: list[int] = []
    settle = Publisher.settle

    async def counted(self: Publisher, held: list[Any], groups: list[Any], **kw: Any) -> None:
        sizes.append(len(held))
        await settle(self, held, groups, **kw)

    monkeypatch.setattr(Publisher, "settle", counted)
    backend = EpisodeBackend()
    async with Harness(tmp_path, backend=backend) as h:
        await h.tasks("train", 3)
        await h.admit(3)
        await eventually(lambda: h.published() == Counter(train=3), what="every group published")
        await eventually(lambda: h.waiting("train") == 0, what="every task acked")
        assert sum(sizes) == 3 and len(sizes) < 3, f"settled in {sizes}: one publish per run, not per group"


async def test_a_publish_that_fails_hands_every_group_of_its_run_back_and_they_come_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbus.bus.protocol import BusError
    from rlbus.services.generator.episodes import EpisodeDriver
    from rlbus.services.generator.publisher import Publisher

    failures = [1]
    settle = Publisher.settle

    async def flaky(self: Publisher, held: list[Any], groups: list[Any], **kw: Any) -> None:
        if failures[0]:
            failures[0] -= 1
            raise BusError("the server stayed away past publish_outage_s")
        await settle(self, held, groups, **kw)

    monkeypatch.setattr(Publisher, "settle", flaky)
    monkeypatch.setattr(EpisodeDriver, "SAMPLING_RETRY_S", 0.1)
    async with Harness(tmp_path, backend=EpisodeBackend()) as h:
        await h.tasks("train", 3)
        await h.admit(6)  # room for the redelivered ones: their first grant was given back
        await eventually(lambda: h.published() == Counter(train=3), what="every group published once")
        await eventually(lambda: h.waiting("train") == 0, what="every task acked")
        assert not failures[0], "the first settle failed"
        await eventually(lambda: h.metric("generator/episode_tasks") == 0, what="no group left in the driver")


async def test_the_slowdown_stretches_episode_engine_runs_too(tmp_path: Path) -> None:
    from rlbus.services.generator.backend import SampleMeter

    meter = SampleMeter(slowdown=3.0)
    t0 = time.perf_counter()
    assert meter.paced(lambda: time.sleep(0.05) or "ran") == "ran"
    assert time.perf_counter() - t0 >= 0.15 and meter.sample_seconds >= 0.15


class ExactEngine(FakeEngine):
    """Deterministic mode's engine: `episode_logprobs` gives -0.25 at every token after the prompt,
    or raises while ``broken`` (a recompute that failed)."""

    deterministic = True

    def __init__(self, backend: FakeBackend) -> None:
        super().__init__(backend)
        self.recomputes: list[list[tuple[list[int], list[int], int]]] = []
        self.broken = False

    def episode_logprobs(self, episodes: list[tuple[list[int], list[int], Any, int]]) -> list[np.ndarray | None]:
        if self.broken:
            raise RuntimeError("out of memory")
        self.recomputes.append([(list(p), list(c), v) for p, c, _, v in episodes])
        return [np.full(len(c), -0.25, np.float32) if v == self.backend.version else None for _, c, _, v in episodes]


async def test_deterministic_episodes_are_recomputed_whole_before_their_group_settles(tmp_path: Path) -> None:
    """Every two-turn episode gets the engine's whole-sequence values at its policy tokens (0 at the
    observation's) and claims them exact; a failed recompute costs the claim, never the group."""
    backend = EpisodeBackend()
    backend.engine = ExactEngine(backend)
    async with Harness(tmp_path, backend=backend, env=False) as h:
        await EpisodicEnv(h).start()
        await episodic_task(h)
        await played(h)
        for r in h.groups()[0].rollouts:
            assert r.behaviour_logprobs.tolist() == [-0.25, -0.25, 0.0, 0.0, -0.25, -0.25]
            assert r.exact_logprobs
        recomputed = [episode for batch in backend.engine.recomputes for episode in batch]
        assert recomputed == [(PROMPT, TURN + OBSERVATION + TURN, 0)] * 2  # (prompt, the rest, its version)
        await eventually(lambda: h.metric("generator/episodes_recomputed") == 2, what="recomputes counted")
        backend.engine.broken = True
        await episodic_task(h, "ep-1")
        await played(h, 2)
        rollouts = {g.task.task_id: g.rollouts for g in h.groups()}["ep-1"]
        assert all(not r.exact_logprobs and r.behaviour_logprobs.tolist()[:2] == [-0.5, -0.5] for r in rollouts)
        await eventually(lambda: h.metric("generator/episodes_recompute_missed") == 2, what="misses counted")


def test_deterministic_mode_keeps_single_turn_tasks_on_the_batch_path_unless_told_otherwise() -> None:
    from rlbus.services.generator.settings import GeneratorSettings

    assert GeneratorSettings().single_turn_episodes
    assert not GeneratorSettings(deterministic=True).single_turn_episodes
    assert GeneratorSettings(deterministic=True, single_turn="episodes").single_turn_episodes  # set: obeyed
    assert not GeneratorSettings(single_turn="batch").single_turn_episodes
