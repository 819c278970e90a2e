"""Environment request/reply, token-in/token-out, for single-turn tasks and multi-turn episodes.

An episode is one token sequence: the prompt (``reset``'s observation), then policy turns and the
observations the environment answers them with (``step``), appended as ids and never re-tokenised.
Every sample of a task is its own episode, named by its ``episode_id``.  ``reset`` is stateless
(one round trip per batch renders each task's prompt and says whether it is episodic); an episodic
environment opens an episode's state at its first ``step`` (turn 1, on any replica of the queue
group) and keeps it, with a TTL, in that replica (``EnvReply.replica``): the generator sends the
episode's later steps to that replica's own step subject.  State stays where the tool runs (a
sandbox directory, a process), which a key-value bucket could not hold.  A later turn of an
episode the replica does not hold (unknown, expired, or the replica restarted) is refused with an
error that says so.

Two kinds of failure end an episode, and they are told apart because they are trained on
differently: ``failure="policy"`` (a malformed or unknown tool call: the policy's fault, scored as
usual) and ``failure="environment"`` (a tool or service error: excluded from the loss, counted,
never rewarded 0).  ``error`` is different again: the request itself was refused (unknown
environment, bad task, unknown or expired episode); the task is dead-lettered with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbus.schemas.base import ArraySpec, Message, array_field, invalid
from rlbus.schemas.task import Task

I32 = array_field(ArraySpec("<i4"))

# Why an episode ended: a Rollout's finish_reason.  The first two are a turn's own end (the policy
# stopped, or its max_new_tokens ran out) on a single-turn task.
EPISODE_ENDS = (
    "stop", "length",
    "done",  # the environment ended it (an answer was given)
    "max_turns", "max_total_tokens", "max_tool_time",  # a limit of Task.limits
    "context",  # the next observation would not fit the model's context
    "policy_error",  # failure="policy": a malformed or unknown tool call
    "env_error",  # failure="environment": excluded from the loss, never rewarded 0
)
FAILURES = ("", "policy", "environment")


@dataclass(frozen=True)
class EnvReset(Message):
    KIND = "env_reset"
    task: Task


@dataclass(frozen=True)
class EnvStep(Message):
    """The policy's turn ``turn`` (1-based) of an episode: its sampled ids and their text."""

    KIND = "env_step"
    task: Task
    episode_id: str
    action_ids: I32 = field(default_factory=lambda: np.zeros(0, dtype="<i4"))
    action_text: str = ""
    turn: int = 1

    def validate(self) -> None:
        if not self.episode_id:
            raise invalid(self, "episode_id", "must name the episode its reset opened")
        if not 1 <= self.turn <= 1 << 20:
            raise invalid(self, "turn", "must be the policy turn's number, from 1", got=str(self.turn))


@dataclass(frozen=True)
class EnvReply(Message):
    """Observation tokens to append (prompt on reset), done flag, or an error."""

    KIND = "env_reply"
    episode_id: str
    observation_ids: I32 = field(default_factory=lambda: np.zeros(0, dtype="<i4"))
    observation_text: str = ""
    done: bool = False
    error: str = ""  # the request was refused (the task is dead-lettered with this)
    info: dict[str, Any] = field(default_factory=dict)
    episodic: bool = False  # on reset: the policy's turns go to ``step`` until done (False: one completion ends it)
    replica: str = ""  # on step: the instance holding the episode's state; its later steps go to its subject
    failure: str = ""  # with done: "policy" or "environment" (see the module docstring)
    finish_reason: str = ""  # with done: why it ended, one of EPISODE_ENDS
    tool_s: float = 0.0  # seconds the environment's tools spent on this step

    def validate(self) -> None:
        if self.failure not in FAILURES:
            raise invalid(self, "failure", "must be '', 'policy' or 'environment'", got=repr(self.failure)[:40])
        if self.finish_reason and self.finish_reason not in EPISODE_ENDS:
            raise invalid(self, "finish_reason", f"must be one of {', '.join(EPISODE_ENDS)}",
                          got=repr(self.finish_reason)[:40])


@dataclass(frozen=True)
class EnvResetBatch(Message):
    """The resets of a generator's whole batch in one round trip (single-turn tasks need one
    reset each; a request per task would cost a bus round trip per sample group)."""

    KIND = "env_reset_batch"
    tasks: list[Task]
    episode_ids: list[str] = field(default_factory=list)  # one per task (a task repeated per sample); []: task ids

    def validate(self) -> None:
        if not self.tasks:
            raise invalid(self, "tasks", "a batch needs at least one task")
        if self.episode_ids and len(self.episode_ids) != len(self.tasks):
            raise invalid(self, "episode_ids", "must name one episode per task, or be empty",
                          expected=str(len(self.tasks)), got=str(len(self.episode_ids)))


@dataclass(frozen=True)
class EnvReplyBatch(Message):
    """One EnvReply per task of an EnvResetBatch, in its order; an item's error refuses only that task."""

    KIND = "env_reply_batch"
    replies: list[EnvReply]
    error: str = ""  # the whole request was unreadable (then ``replies`` is empty)
