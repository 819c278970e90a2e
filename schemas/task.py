"""Tasks: what a generator is asked to sample, published by ``rlbus publish`` or a feeder."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbus.schemas.base import ArraySpec, Message, array_field, invalid

I32 = array_field(ArraySpec("<i4"))

# A task's ``pool`` and ``env`` become tokens of subjects (``rl.<run>.tasks.<pool>``,
# ``rl.<run>.rollouts.<pool>``, ``rl.<run>.env.<env>.reset_batch``).  A dot, a space, a wildcard or
# a control character there would widen a subscription or break the NATS protocol line, and the
# generator holding the task would fail on it: such a task is refused where it is decoded.
SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
SUBJECT_TOKEN_RULE = "1-64 ASCII letters, digits, '_' or '-' (no dots, spaces, wildcards '*' '>' or control characters)"


def subject_token_problem(value: object) -> str:
    """Why ``value`` cannot be a subject token ('' when it can)."""
    if not isinstance(value, str) or SUBJECT_TOKEN.fullmatch(value) is None:
        return f"must be a NATS subject token: {SUBJECT_TOKEN_RULE}"
    return ""


@dataclass(frozen=True)
class SamplingParams(Message):
    """How tokens are drawn.  Travels with the task *and* the rollout: the trainer recomputes
    logprobs of the same processed distribution (temperature, top-p) the generator sampled from,
    so the two sides cannot silently compare different distributions."""

    KIND = "sampling"
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def validate(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise invalid(self, "temperature", "must be finite and >= 0 (0 = greedy)", got=str(self.temperature))
        if not (0.0 < self.top_p <= 1.0):
            raise invalid(self, "top_p", "must be in (0, 1]", got=str(self.top_p))
        if self.max_new_tokens < 1:
            raise invalid(self, "max_new_tokens", "must be >= 1", got=str(self.max_new_tokens))
        if not isinstance(self.stop, list) or not all(isinstance(x, str) and x for x in self.stop):
            raise invalid(self, "stop", "must be a list of non-empty strings", got=repr(self.stop)[:80])


@dataclass(frozen=True)
class EpisodeLimits(Message):
    """Bounds of one episode (every sample of a task is its own episode).  Hitting one ends the
    episode with that limit as its finish reason (``rlbus.schemas.env.EPISODE_ENDS``); single-turn
    environments end after the first completion whatever these say."""

    KIND = "episode_limits"
    max_turns: int = 8  # policy turns
    max_total_tokens: int = 0  # prompt + every turn's policy and observation tokens; 0: the model's context
    max_tool_s: float = 30.0  # tool time the environment may spend on the episode, summed over its steps

    def validate(self) -> None:
        if not 1 <= self.max_turns <= 256:
            raise invalid(self, "max_turns", "must be in [1, 256]", got=str(self.max_turns))
        if self.max_total_tokens < 0:
            raise invalid(self, "max_total_tokens", "must be >= 0 (0: the model's context)",
                          got=str(self.max_total_tokens))
        if not (math.isfinite(self.max_tool_s) and 0.0 < self.max_tool_s <= 3600.0):
            raise invalid(self, "max_tool_s", "must be in (0, 3600] seconds", got=str(self.max_tool_s))


@dataclass(frozen=True)
class Task(Message):
    """One prompt to be sampled ``group_size`` times.

    Either ``prompt`` (text, tokenised by the environment/generator) or ``prompt_ids`` is given.
    ``answer`` is the verifier's reference; it never reaches the policy.
    """

    KIND = "task"
    run: str
    task_id: str
    pool: str
    env: str
    prompt: str = ""
    prompt_ids: I32 = field(default_factory=lambda: np.zeros(0, dtype="<i4"))
    env_config: dict[str, Any] = field(default_factory=dict)
    answer: str = ""
    verifier: str = ""  # empty: the environment's default verifier
    group_size: int = 8
    sampling: SamplingParams = field(default_factory=SamplingParams)
    metadata: dict[str, Any] = field(default_factory=dict)
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    eval: bool = False  # held-out evaluation: scored and reported, never trained on

    def validate(self) -> None:
        if not self.task_id:
            raise invalid(self, "task_id", "must be a non-empty string")
        if not self.prompt and len(self.prompt_ids) == 0:
            raise invalid(self, "prompt", "the task has an empty prompt: give 'prompt' text or 'prompt_ids'")
        if not 1 <= self.group_size <= 1024:
            raise invalid(self, "group_size", "must be in [1, 1024]", got=str(self.group_size))
        if not self.env:
            raise invalid(self, "env", f"must name an environment (e.g. 'addition'), a NATS subject token: "
                                       f"{SUBJECT_TOKEN_RULE}")
        for name in ("pool", "env"):
            problem = subject_token_problem(getattr(self, name))
            if problem:
                raise invalid(self, name, f"{problem}; rename the {name} where the task is published",
                              expected="a subject token", got=repr(getattr(self, name))[:80])

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id`` on TASKS: a task published twice is stored once."""
        return f"task.{self.task_id}"
