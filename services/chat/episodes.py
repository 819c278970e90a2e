"""Chat episodes and the groups they are published in.

An episode is opened by its first request (named by the `x-rlbus-episode` header, or given an id
the response's header returns), continues while its requests repeat its conversation, and ends
when the agent reports it (`POST /v1/rlbus/episodes/{id}/end`, optionally with a reward).  An
episode that sees no request for `episode_ttl_s` is abandoned: dropped and counted, never
published, since no one reported how it ended.

Groups: GRPO compares the episodes of one task, so an ended episode waits in its task's group
(task named by `x-rlbus-task`; without one an episode is a task of its own) until `group_size` of
them have ended, and the group is published as one RolloutGroup.  If the group is still short
`group_timeout_s` after its first episode ended, it is published with the episodes that ended by
then, as long as there are at least two (one episode has no group-relative signal: it is dropped
and counted).  After a task's group is published, a new episode for that task id is refused (its
rollouts would be deduplicated away by the group's message id) and a still-open one is dropped
at its end, counted.

Reported rewards travel in the published task's metadata (`reported_rewards`: rollout id ->
reward), read by the `reported` verifier: no wire schema changes, and the reward service stays
the one place that scores.  An agent that reports its own reward is trusted to; tasks that need
reward integrity name another verifier.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbus.schemas import Rollout, RolloutGroup, SamplingParams, Task
from rlbus.schemas.rollout import spans_from_versions
from rlbus.schemas.task import subject_token_problem
from rlbus.services.chat.errors import ChatError, Conflict, NotFound
from rlbus.services.chat.stitch import Conversation, EpisodeTokens


@dataclass(frozen=True)
class TaskRef:
    """What the agent said the episode belongs to (headers of its first request)."""

    task_id: str
    pool: str
    env: str
    group_size: int
    verifier: str = ""

    def check(self) -> None:
        for name in ("pool", "env"):
            problem = subject_token_problem(getattr(self, name))
            if problem:
                raise ChatError(f"x-rlbus-{name} {getattr(self, name)!r} {problem}", code=f"invalid_{name}")
        if not self.task_id or len(self.task_id) > 200:
            raise ChatError("x-rlbus-task must be a non-empty id of at most 200 characters", code="invalid_task")
        if not 1 <= self.group_size <= 1024:
            raise ChatError(f"x-rlbus-group-size {self.group_size} must be in [1, 1024]", code="invalid_group_size")


@dataclass
class ChatEpisode:
    episode_id: str
    task: TaskRef
    conversation: Conversation
    temperature: float
    top_p: float
    tokens: EpisodeTokens = field(default_factory=EpisodeTokens)
    turns: int = 0
    max_new_tokens: int = 1
    finish_reason: str = "stop"
    closed: str = ""  # why no further request is taken ('' while open)
    reward: float | None = None
    last_text: str = ""
    last_active: float = field(default_factory=time.monotonic)

    def rollout(self, index: int, generator_id: str) -> Rollout:
        t = self.tokens
        return Rollout(rollout_id=self.episode_id, task_id=self.task.task_id, index=index,
                       token_ids=np.asarray(t.ids, dtype="<i4"), prompt_len=t.prompt_len,
                       loss_mask=np.asarray(t.mask, dtype="|u1"), behaviour_logprobs=np.asarray(t.logprobs, "<f4"),
                       version_spans=spans_from_versions(np.asarray(t.versions)), finish_reason=self.finish_reason,
                       text=self.last_text, generator_id=generator_id, turns=self.turns)


@dataclass
class Group:
    task: TaskRef
    ended: list[ChatEpisode] = field(default_factory=list)
    first_end: float = 0.0


class EpisodeBook:
    """Open episodes by id, the groups their ended episodes wait in, and what was dropped."""

    def __init__(self, *, run: str, generator_id: str, episode_ttl_s: float, group_timeout_s: float) -> None:
        self.run = run
        self.generator_id = generator_id
        self.episode_ttl_s = episode_ttl_s
        self.group_timeout_s = group_timeout_s
        self.open: dict[str, ChatEpisode] = {}
        self.groups: dict[str, Group] = {}
        self.published_tasks: set[str] = set()
        self.ended_ids: set[str] = set()  # an id is one episode: reusing it would merge two in one group
        self.dropped = {"abandoned": 0, "lone": 0, "late": 0}

    def new_id(self) -> str:
        return f"ep-{uuid.uuid4().hex[:16]}"

    def check_new_id(self, episode_id: str) -> None:
        if episode_id in self.ended_ids:
            raise Conflict(f"episode {episode_id!r} has ended: give a new episode a new id", code="episode_closed")

    def check_task_open(self, task_id: str) -> None:
        if task_id in self.published_tasks:
            raise Conflict(f"task {task_id!r}'s group was already published: give new episodes a new task id",
                           code="task_published")

    def get(self, episode_id: str) -> ChatEpisode:
        episode = self.open.get(episode_id)
        if episode is None:
            raise NotFound(f"no open episode {episode_id!r} on this generator: it ended, was abandoned after "
                           f"{self.episode_ttl_s:g} s idle, or never existed; start a new episode without "
                           "earlier turns", code="unknown_episode")
        return episode

    def by_prefix(self, messages: list[dict[str, Any]]) -> ChatEpisode | None:
        """The open episode whose conversation `messages` continues (requests without an episode header)."""
        # Only episodes with an answered turn: one whose first request is still being sampled holds no
        # conversation yet, and every fresh conversation would "extend" it.
        found = [e for e in self.open.values() if e.turns and not e.closed and e.conversation.extends(messages)]
        # The longest match is the one the client continued (a shorter one is an earlier branch).
        return max(found, key=lambda e: len(e.conversation.messages), default=None)

    def end(self, episode_id: str, reward: float | None, now: float | None = None) -> RolloutGroup | None:
        """End an episode; the group to publish when this completes one."""
        episode = self.get(episode_id)
        if episode.turns == 0:
            raise Conflict(f"episode {episode_id!r} has no sampled turn yet: nothing to train on",
                           code="empty_episode")
        del self.open[episode_id]
        self.ended_ids.add(episode_id)
        episode.reward = reward
        if episode.task.task_id in self.published_tasks:
            self.dropped["late"] += 1
            return None
        now = time.monotonic() if now is None else now
        group = self.groups.setdefault(episode.task.task_id, Group(episode.task, first_end=now))
        group.ended.append(episode)
        if len(group.ended) >= group.task.group_size:
            return self._publishable(episode.task.task_id)
        return None

    def due(self, now: float | None = None) -> list[RolloutGroup]:
        """Abandon idle episodes; the short groups whose timeout passed (lone ones are dropped)."""
        now = time.monotonic() if now is None else now
        for eid in [eid for eid, e in self.open.items() if now - e.last_active > self.episode_ttl_s]:
            del self.open[eid]
            self.ended_ids.add(eid)
            self.dropped["abandoned"] += 1
        out = []
        for task_id in [t for t, g in self.groups.items() if now - g.first_end > self.group_timeout_s]:
            if len(self.groups[task_id].ended) >= 2:
                out.append(self._publishable(task_id))
            else:
                del self.groups[task_id]
                self.published_tasks.add(task_id)
                self.dropped["lone"] += 1
        return out

    def _publishable(self, task_id: str) -> RolloutGroup:
        group = self.groups.pop(task_id)
        self.published_tasks.add(task_id)
        first = group.ended[0]
        rewards = {e.episode_id: e.reward for e in group.ended if e.reward is not None}
        # The trainer recomputes logprobs under one distribution per group: the endpoint refuses a
        # request whose temperature/top_p differs from its task's, so the first episode's hold for all.
        sampling = SamplingParams(temperature=first.temperature, top_p=first.top_p,
                                  max_new_tokens=max(e.max_new_tokens for e in group.ended))
        prompt = first.conversation.template.tokenizer.decode(first.tokens.ids[: first.tokens.prompt_len])
        task = Task(run=self.run, task_id=task_id, pool=group.task.pool, env=group.task.env, prompt=prompt,
                    prompt_ids=np.asarray(first.tokens.ids[: first.tokens.prompt_len], dtype="<i4"),
                    verifier=group.task.verifier or ("reported" if rewards else ""), group_size=len(group.ended),
                    sampling=sampling, metadata={"source": "openai_endpoint", "reported_rewards": rewards})
        rollouts = [e.rollout(i, self.generator_id) for i, e in enumerate(group.ended)]
        return RolloutGroup(task=task, rollouts=rollouts, sampling=sampling, generator_id=self.generator_id,
                            created_at=time.time())
