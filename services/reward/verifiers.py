"""Verifiers: rollout -> reward, components and a human-readable detail.

A verifier that raises does not score the rollout 0: the reward service marks it
``verifier_error`` and the trainer excludes it (a crash is not evidence the answer was wrong).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from schemas import Rollout, Task
from services.runtime.registry import Registry


@dataclass(frozen=True)
class Verdict:
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    detail: str = ""


class Verifier(Protocol):
    def __call__(self, task: Task, rollout: Rollout) -> Verdict: ...


VERIFIERS: Registry[Verifier] = Registry("verifier")


@VERIFIERS.register("addition")
class AdditionVerifier:
    """Exact match of the completion with the task's answer (no partial credit)."""

    def __call__(self, task: Task, rollout: Rollout) -> Verdict:
        from services.tasks.addition import score

        if not task.answer:
            raise ValueError(f"addition task {task.task_id!r} carries no reference answer")
        correct = score(task.answer, rollout.text)
        fmt = FormatVerifier()(task, rollout).reward
        return Verdict(correct, {"correct": correct, "format": fmt},
                       f"expected {task.answer!r}, got {rollout.text.strip()!r}")


@VERIFIERS.register("format")
class FormatVerifier:
    """The completion ended on its own (not cut at max tokens) and is a bare number."""

    _NUMBER = re.compile(r"^-?\d+(\.\d+)?$")

    def __call__(self, task: Task, rollout: Rollout) -> Verdict:
        ok = rollout.finish_reason == "stop" and bool(self._NUMBER.match(rollout.text.strip()))
        return Verdict(1.0 if ok else 0.0, {"format": 1.0 if ok else 0.0})


@VERIFIERS.register("math")
class MathVerifier:
    """Mathematical equivalence with the reference via the ``math-verify`` library."""

    def __call__(self, task: Task, rollout: Rollout) -> Verdict:
        from math_verify import parse, verify

        gold = parse(task.answer)
        pred = parse(rollout.text)
        if not gold:
            raise ValueError(f"math task {task.task_id!r}: reference answer {task.answer!r} does not parse")
        ok = bool(pred) and bool(verify(gold, pred))
        return Verdict(1.0 if ok else 0.0, {"correct": 1.0 if ok else 0.0},
                       f"gold={gold!r} pred={pred!r}")


@VERIFIERS.register("reported")
class ReportedVerifier:
    """The reward an agent reported when it ended its episode on the chat endpoint
    (services/chat/episodes.py puts it in the task's metadata, keyed by rollout id).  An episode
    whose agent reported none raises: excluded from the loss, not scored 0."""

    def __call__(self, task: Task, rollout: Rollout) -> Verdict:
        rewards = task.metadata.get("reported_rewards")
        reward = rewards.get(rollout.rollout_id) if isinstance(rewards, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ValueError(f"episode {rollout.rollout_id!r} of task {task.task_id!r} has no reported reward: "
                             "report one in its end call, or name a verifier that scores it")
        return Verdict(float(reward), {"reported": float(reward)}, "reward reported by the agent")


def verifier_for(task: Task) -> str:
    """The verifier a task asks for, or its environment's default (same name)."""
    return task.verifier or task.env
