"""Code environments, on the sandbox (``rlbus.services.sandbox``): ``python`` and ``code-tests``.

``python`` is episodic: each turn's fenced Python blocks (``rlbus.services.tasks.code``) run as one
program in a fresh sandbox run (nothing carries over between turns: no files, no variables), and
the observation is its exit status, stdout and stderr, each stream cut to ``observation_chars``
characters.  A turn without a block is the final answer.  A run's wall clock is the smaller of the
sandbox limit and what is left of the task's tool time (``Task.limits.max_tool_s``), so an episode
cannot overrun its budget by more than one kill's latency.  What the program does wrong (an
exception, an infinite loop, a memory bomb) is an observation, not a failure: the policy sees it
and may fix its code.  A malformed block is a policy failure; a sandbox that cannot run at all is
an environment failure.

``code-tests`` is single-turn: the completion's program (``rlbus.services.tasks.code.submission``) is
scored by the reward service's ``code-tests`` verifier against hidden tests carried in
``Task.answer``, which no environment sees.  The episodic variant is a task with
``env = "python"`` and ``verifier = "code-tests"``: the policy tries code with the tool, and the
last program it wrote is checked.

Both are registered lazily (``envs.ENVIRONMENTS``): a service that never serves them never
imports the sandbox.  Sandbox runs are awaited (subprocesses with pipes read by the event loop), so the service keeps
answering other episodes while one runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlbus.schemas import Task
from rlbus.services.environment.envs import PolicyError, PromptEnv, SingleTurnEnv, Turn
from rlbus.services.runtime.tokens import TextCodec
from rlbus.services.sandbox import Execution, Sandbox
from rlbus.services.tasks.code import CodeFormatError, code_blocks

OBSERVATION_CHARS = 2000
# The smallest wall clock a run gets when the tool budget is nearly spent (a run needs some time to start).
MIN_RUN_S = 0.5
_LIMIT_TEXT = {"wall": "killed: wall-clock limit", "cpu": "killed: CPU-time limit", "memory": "memory limit hit",
               "file_size": "file-size limit hit", "output": "killed: output limit"}


def cut(text: str, chars: int) -> str:
    """``text`` cut to ``chars`` characters, saying how many were cut."""
    if len(text) <= chars:
        return text
    return text[:chars] + f"\n[... {len(text) - chars} more characters cut]"


def render_execution(ex: Execution, chars: int) -> str:
    status = _LIMIT_TEXT.get(ex.limit_hit or "", "") or (
        f"killed by signal {ex.signal}" if ex.signal else f"exit status {ex.exit_code}")
    out = [status]
    for name, data, truncated in (("stdout", ex.stdout, ex.stdout_truncated), ("stderr", ex.stderr, ex.stderr_truncated)):
        if data or truncated:
            text = cut(data.decode("utf-8", "replace"), chars)
            out.append(f"{name}:\n{text}" + ("\n[... output cut by the sandbox]" if truncated else ""))
    return "\n".join(out) + "\n"


@dataclass
class PythonEpisode:
    task: Task
    runs: int = 0


class PythonEnv(PromptEnv):
    """A Python tool: the policy's code runs in the sandbox, its output is the observation."""

    episodic: ClassVar[bool] = True
    sandboxed: ClassVar[bool] = True  # the service passes its Sandbox

    def __init__(self, codec: TextCodec, sandbox: Sandbox, observation_chars: int = OBSERVATION_CHARS) -> None:
        super().__init__(codec)
        self.sandbox, self.observation_chars = sandbox, observation_chars

    def open(self, task: Task, episode_id: str) -> PythonEpisode:
        return PythonEpisode(task)

    async def step(self, state: PythonEpisode, action_text: str, budget_s: float) -> Turn:
        try:
            blocks = code_blocks(action_text)
        except CodeFormatError as exc:
            raise PolicyError(f"python: {exc}") from None
        if not blocks:
            return Turn(done=True, finish_reason="done")
        limits = self.sandbox.settings.limits
        limits = limits.model_copy(update={"wall_s": max(min(limits.wall_s, budget_s), MIN_RUN_S)})
        ex = await self.sandbox.run_code("\n".join(blocks), limits=limits)
        state.runs += 1
        return Turn(observation=render_execution(ex, self.observation_chars), tool_s=ex.wall_s)

    def close(self, state: PythonEpisode) -> None:
        """Nothing to free: every run's directory and processes are gone when the run returns."""


class CodeTestsEnv(SingleTurnEnv):
    """The task's prompt asks for a program; the reward service runs the hidden tests."""
