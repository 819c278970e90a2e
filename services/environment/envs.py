"""Environments: task -> prompt tokens, action tokens -> observation tokens / done.

Token-in/token-out so multi-turn tool environments fit the same interface: ``reset`` returns
the first observation (the prompt), ``step`` returns what to append after the policy's action
and whether the episode is over.  Two kinds:

- single-turn (``Environment``): ``step`` ends the episode after one completion; no state.
- episodic (``EpisodicEnvironment``, ``episodic = True``): ``open`` makes an episode's state at its
  first step, ``step(state, action_text, budget_s)`` answers one policy turn with a ``Turn`` (text,
  not ids: the service encodes it, so no environment can prepend a BOS or drift from the codec),
  ``close`` frees the state.  The service (``episodes.EpisodeHost``) keeps the state between turns
  and enforces the task's limits; ``step`` raises ``PolicyError`` for a turn that is the policy's
  fault (a malformed or unknown tool call), and any other exception is an environment failure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from rlbus.schemas import EnvReply, Task
from rlbus.services.runtime.registry import Registry, UnknownExtension
from rlbus.services.runtime.tokens import TextCodec


class EnvError(RuntimeError):
    """The environment cannot serve this task (bad config, bad prompt); not retryable."""


class PolicyError(Exception):
    """The policy's turn is malformed or calls an unknown tool: the episode ends (finish reason
    ``policy_error``) and is scored as usual.  The message says what was wrong."""


@dataclass(frozen=True)
class Turn:
    """An episodic environment's answer to one policy turn."""

    observation: str = ""  # text appended after the turn (encoded by the service, no BOS)
    done: bool = False
    finish_reason: str = ""  # with done: one of rlbus.schemas.env.EPISODE_ENDS
    tool_s: float = 0.0  # seconds the tools spent on this turn (summed against Task.limits.max_tool_s)


class Environment(Protocol):
    def reset(self, task: Task, episode_id: str) -> EnvReply: ...

    def step(self, task: Task, episode_id: str, action_ids: np.ndarray, action_text: str) -> EnvReply: ...


class EpisodicEnvironment(Protocol):
    episodic: ClassVar[bool]  # True

    def reset(self, task: Task, episode_id: str) -> EnvReply: ...

    def open(self, task: Task, episode_id: str) -> Any: ...

    async def step(self, state: Any, action_text: str, budget_s: float) -> Turn: ...

    def close(self, state: Any) -> None: ...


ENVIRONMENTS: Registry[Environment | EpisodicEnvironment] = Registry("environment", lazy={
    "python": "rlbus.services.environment.code:PythonEnv",
    "code-tests": "rlbus.services.environment.code:CodeTestsEnv"})


def check_task(task: Task) -> None:
    """The environment's own check of a task before it is published (a ``check_task`` on its class, which
    raises ValueError with the reason), where the environment is installed here and has one."""
    try:
        factory = ENVIRONMENTS.get(task.env)
    except UnknownExtension:
        return  # an environment may be installed only where the environment service runs
    check = getattr(factory, "check_task", None)
    if check is not None:
        check(task)


def _ids(x: list[int]) -> np.ndarray:
    return np.asarray(x, dtype="<i4")


class PromptEnv:
    """Renders a task's prompt as the policy sees it (``reset``); the base of every environment here."""

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
        return EnvReply(episode_id=episode_id, observation_ids=_ids(ids), observation_text=self.render(task),
                        episodic=getattr(self, "episodic", False))


@ENVIRONMENTS.register("single_turn")
class SingleTurnEnv(PromptEnv):
    """Prompt in, one completion out, done.  Scoring is the reward service's job."""

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


@dataclass
class CalculatorEpisode:
    task: Task
    calls: int = 0


@ENVIRONMENTS.register("calculator")
class CalculatorEnv(PromptEnv):
    """The sum of four 3-digit numbers with an arithmetic tool; the format is
    ``rlbus.services.tasks.calculator``'s (``calc(EXPR)`` answered by ``=VALUE ``)."""

    episodic: ClassVar[bool] = True

    def render(self, task: Task) -> str:
        from rlbus.services.tasks.calculator import TERMS, render_prompt

        if task.prompt:
            return task.prompt
        terms = task.env_config.get("terms")
        if not (isinstance(terms, list) and len(terms) == TERMS and all(type(t) is int for t in terms)):
            raise EnvError(f"calculator task {task.task_id!r} needs a prompt or env_config {{terms: [{TERMS} "
                           f"integers]}}, got terms={terms!r:.80}")
        return render_prompt(terms)

    def open(self, task: Task, episode_id: str) -> CalculatorEpisode:
        return CalculatorEpisode(task)

    async def step(self, state: CalculatorEpisode, action_text: str, budget_s: float) -> Turn:
        from rlbus.services.tasks.calculator import CalcError, evaluate, find_call, observation

        t0 = time.perf_counter()
        try:
            call = find_call(action_text)
            if call is None:
                return Turn(done=True, finish_reason="done")
            value = evaluate(call.expression)
        except CalcError as exc:
            raise PolicyError(f"calculator: {exc}") from None
        state.calls += 1
        return Turn(observation=observation(value), tool_s=time.perf_counter() - t0)

    def close(self, state: CalculatorEpisode) -> None:
        """Nothing to free: the state is the turn count."""
