"""Environment request/reply: token-in/token-out so multi-turn tool environments fit later."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.base import ArraySpec, Message, array_field, invalid
from schemas.task import Task

I32 = array_field(ArraySpec("<i4"))


@dataclass(frozen=True)
class EnvReset(Message):
    KIND = "env_reset"
    task: Task


@dataclass(frozen=True)
class EnvStep(Message):
    KIND = "env_step"
    task: Task
    episode_id: str
    action_ids: I32 = field(default_factory=lambda: np.zeros(0, dtype="<i4"))
    action_text: str = ""


@dataclass(frozen=True)
class EnvReply(Message):
    """Observation tokens to append (prompt on reset), done flag, or an error."""

    KIND = "env_reply"
    episode_id: str
    observation_ids: I32 = field(default_factory=lambda: np.zeros(0, dtype="<i4"))
    observation_text: str = ""
    done: bool = False
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvResetBatch(Message):
    """The resets of a generator's whole batch in one round trip (single-turn tasks need one
    reset each; a request per task would cost a bus round trip per sample group)."""

    KIND = "env_reset_batch"
    tasks: list[Task]

    def validate(self) -> None:
        if not self.tasks:
            raise invalid(self, "tasks", "a batch needs at least one task")


@dataclass(frozen=True)
class EnvReplyBatch(Message):
    """One EnvReply per task of an EnvResetBatch, in its order; an item's error refuses only that task."""

    KIND = "env_reply_batch"
    replies: list[EnvReply]
    error: str = ""  # the whole request was unreadable (then ``replies`` is empty)
