"""Environments: task -> prompt tokens, action tokens -> observation tokens / done.

Token-in/token-out so multi-turn tool environments fit the same interface: ``reset`` returns
the first observation (the prompt), ``step`` returns what to append after the policy's action
and whether the episode is over.  The single-turn verifiable environment ends after one step.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from schemas import EnvReply, Task
from services.runtime.registry import Registry
from services.runtime.tokens import TextCodec


class EnvError(RuntimeError):
    """The environment cannot serve this task (bad config, bad prompt); not retryable."""


class Environment(Protocol):
    def reset(self, task: Task, episode_id: str) -> EnvReply: ...

    def step(self, task: Task, episode_id: str, action_ids: np.ndarray, action_text: str) -> EnvReply: ...


ENVIRONMENTS: Registry[Environment] = Registry("environment")


def _ids(x: list[int]) -> np.ndarray:
    return np.asarray(x, dtype="<i4")


@ENVIRONMENTS.register("single_turn")
class SingleTurnEnv:
    """Prompt in, one completion out, done.  Scoring is the reward service's job."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec

    def prompt_ids(self, task: Task) -> list[int]:
        if len(task.prompt_ids):
            ids = [int(i) for i in task.prompt_ids]
        else:
            ids = self.codec.encode(self.render(task))
        if self.codec.bos_id is not None and (not ids or ids[0] != self.codec.bos_id):
            ids = [self.codec.bos_id, *ids]
        return ids

    def render(self, task: Task) -> str:
        return task.prompt

    def reset(self, task: Task, episode_id: str) -> EnvReply:
        ids = self.prompt_ids(task)
        if len(ids) <= (1 if self.codec.bos_id is not None else 0):
            raise EnvError(f"task {task.task_id!r} has an empty prompt after tokenisation")
        return EnvReply(episode_id=episode_id, observation_ids=_ids(ids), observation_text=self.render(task))

    def step(self, task: Task, episode_id: str, action_ids: np.ndarray, action_text: str) -> EnvReply:
        return EnvReply(episode_id=episode_id, done=True)


@ENVIRONMENTS.register("addition")
class AdditionEnv(SingleTurnEnv):
    """3-digit addition: the prompt is ``a+b=``, built from env_config when no text is given."""

    def render(self, task: Task) -> str:
        if task.prompt:
            return task.prompt
        try:
            return f"{int(task.env_config['a'])}+{int(task.env_config['b'])}="
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(
                f"addition task {task.task_id!r} needs a prompt or env_config {{a, b}} integers ({exc})"
            ) from None


@ENVIRONMENTS.register("math")
class MathEnv(SingleTurnEnv):
    """Free-form math word problems: the prompt text as is; answers checked by math-verify."""
