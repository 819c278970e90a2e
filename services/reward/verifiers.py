"""Verifiers: rollout -> reward, components and a human-readable detail.

A verifier that raises does not score the rollout 0: the reward service marks it
``verifier_error`` and the trainer excludes it (a crash is not evidence the answer was wrong).
A verifier that runs code returns an awaitable verdict (the reward service awaits it, so the
service keeps scoring other groups while a program runs) and says ``sandboxed = True``: the
service then builds it with its one ``Sandbox``.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from rlbus.schemas import Rollout, Task
from rlbus.services.runtime.registry import Registry


@dataclass(frozen=True)
class Verdict:
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    detail: str = ""


class Verifier(Protocol):
    def __call__(self, task: Task, rollout: Rollout) -> Verdict | Awaitable[Verdict]: ...


VERIFIERS: Registry[Verifier] = Registry("verifier")


@VERIFIERS.register("addition")
class AdditionVerifier:
    """Exact match of the completion with the task's answer (no partial credit)."""

    def __call__(self, task: Task, rollout: Rollout) -> Verdict:
        from rlbus.services.tasks.addition import score

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


@VERIFIERS.register("calculator")
class CalculatorVerifier:
    """Exact match of the *final answer* (the text after the last tool round) with the true sum.

    A tool's output is never the answer: a rollout whose last tokens are an observation (it ended
    on a tool round, e.g. at max_turns) or whose final turn only repeats a tool round scores 0,
    however right the tool's value was."""

    def __call__(self, task: Task, rollout: Rollout) -> Verdict:
        from rlbus.services.tasks.calculator import final_answer, score

        if not task.answer:
            raise ValueError(f"calculator task {task.task_id!r} carries no reference answer")
        answer = final_answer(rollout.text)
        ended_on_tool = len(rollout.loss_mask) > 0 and int(rollout.loss_mask[-1]) == 0
        correct = 0.0 if ended_on_tool else score(task.answer, rollout.text)
        tools = 1.0 if answer != rollout.text else 0.0
        why = "the episode ended on a tool's output, with no final answer; " if ended_on_tool else ""
        return Verdict(correct, {"correct": correct, "used_tool": tools},
                       f"{why}expected {task.answer!r}, final answer {answer.strip()[:80]!r} after {rollout.turns} turn(s)")


def hidden_tests(task: Task) -> list:
    """The hidden tests a code-tests task carries in ``answer``: a JSON list of HiddenTest fields."""
    import json

    from rlbus.services.sandbox.checker import HiddenTest

    fields = set(HiddenTest.__dataclass_fields__)
    try:
        items = json.loads(task.answer)
    except json.JSONDecodeError as exc:
        raise ValueError(f"code-tests task {task.task_id!r}: answer is not JSON ({exc}); it must be a list of "
                         f"hidden tests, each an object with keys {sorted(fields)}") from None
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise ValueError(f"code-tests task {task.task_id!r}: answer must be a non-empty JSON list of objects "
                         f"with keys {sorted(fields)}")
    tests = []
    for n, item in enumerate(items):
        if set(item) - fields or "fn" not in item:
            raise ValueError(f"code-tests task {task.task_id!r}: hidden test #{n} has keys {sorted(item)}; "
                             f"'fn' is required and only {sorted(fields)} are known")
        tests.append(HiddenTest(**{**item, "args": tuple(item.get("args", ()))}))
    return tests


@VERIFIERS.register("code-tests")
class CodeTestsVerifier:
    """The submitted program (``rlbus.services.tasks.code.submission``) against the task's hidden tests,
    run by ``HiddenTestChecker`` in the reward service's sandbox.  Reward: the fraction of tests
    passed; any tampering the checker detects scores 0 with its reason in the detail."""

    sandboxed = True  # the reward service passes its Sandbox

    def __init__(self, sandbox) -> None:  # type: ignore[no-untyped-def]
        from rlbus.services.sandbox.checker import HiddenTestChecker

        self.checker = HiddenTestChecker(sandbox)

    async def __call__(self, task: Task, rollout: Rollout) -> Verdict:
        from rlbus.services.tasks.code import submission

        tests = hidden_tests(task)
        program = submission(rollout.text)
        if not program.strip():
            return Verdict(0.0, {"correct": 0.0, "passed": 0.0, "tampering": 0.0}, "no program was submitted")
        v = await self.checker.check(program, tests)
        all_passed = 1.0 if v.total and v.passed == v.total else 0.0
        return Verdict(v.score, {"correct": all_passed, "passed": v.score, "tampering": 1.0 if v.tampering else 0.0},
                       f"{v.passed}/{v.total} hidden tests: {v.reason}")
