"""Environment request/reply: token-in/token-out so multi-turn tool environments fit later."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.base import ArraySpec, Message, array_field
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
