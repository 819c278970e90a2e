"""Hidden-test checker for ``code-tests`` tasks: reward integrity by construction.

The submitted module runs in a fresh sandbox under ``driver.py``, which only calls its
functions with the tests' arguments and reports what came back.  The expected answers stay in
this (trusted) process, so nothing inside the sandbox can read, rewrite or delete them, and the
verdict is decided here from the answers alone: exit status and printed text are never trusted.
What tampering can still do is break the protocol, and every such break is scored as a failure
with its reason: an early exit (``sys.exit(0)``, ``os._exit``, fork-and-exit), extra or
duplicated lines on the reply channel (fake success markers written there), a result that is
not plain data (an object whose ``__eq__`` always says yes), a hit limit.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.services.sandbox.sandbox import Execution, Sandbox, SandboxError, SandboxLimits

DRIVER_INSIDE = "/checker/driver.py"
# No fork and no thread for the submission (bubblewrap's process and the interpreter fill the
# budget): fork-and-exit fails at the fork instead of racing the pid namespace's teardown.
CHECK_LIMITS = SandboxLimits(wall_s=10, cpu_s=5, memory_mb=512, processes=2)


@dataclass(frozen=True)
class HiddenTest:
    """One call of the submitted module: ``fn(*args, **kwargs)`` must return ``expect`` (compared as
    JSON) or raise an exception named ``raises``."""

    fn: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    expect: Any = None
    raises: str | None = None


@dataclass(frozen=True)
class CheckVerdict:
    passed: int
    total: int
    reason: str
    tampering: tuple[str, ...] = ()
    execution: Execution | None = None

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


class HiddenTestChecker:
    """Scores module sources against hidden tests, each in a fresh sandbox run."""

    def __init__(self, sandbox: Sandbox, limits: SandboxLimits = CHECK_LIMITS) -> None:
        self.sandbox, self.limits = sandbox, limits
        # A copy beside the run dirs: readable by the runs' uids without exposing the repository.
        self.driver = sandbox.root / "driver.py"
        shutil.copyfile(Path(__file__).with_name("driver.py"), self.driver)
        self.driver.chmod(0o644)

    async def check(self, source: str, tests: list[HiddenTest], *, module: str = "solution") -> CheckVerdict:
        if not module.isidentifier():
            raise SandboxError(f"module name {module!r} is not a Python identifier: name the submission like a module")
        calls = [{"id": i, "fn": t.fn, "args": list(t.args), "kwargs": dict(t.kwargs)} for i, t in enumerate(tests)]
        request = json.dumps({"module": module, "calls": calls}).encode()
        bwrap = self.sandbox.isolation.bwrap
        driver = DRIVER_INSIDE if bwrap else str(self.driver)
        ex = await self.sandbox.run([self.sandbox.settings.python, "-I", driver], files={f"{module}.py": source},
                                    stdin=request, limits=self.limits,
                                    ro_files={DRIVER_INSIDE: self.driver} if bwrap else None)
        return _Replies(tests, ex).verdict()


class _Replies:
    """Reads the reply channel strictly: anything the driver would not write is tampering."""

    def __init__(self, tests: list[HiddenTest], ex: Execution) -> None:
        self.tests, self.ex = tests, ex
        self.answers: dict[int, dict] = {}
        self.tampering: list[str] = []
        self.done = False
        self.import_error: str | None = None
        self.pid: int | None = None

    def verdict(self) -> CheckVerdict:
        self._read()
        n = len(self.tests)
        if self.import_error is not None:
            return self._fail(f"the submission failed to import: {self.import_error}")
        if self.tampering:
            return self._fail("tampering: " + "; ".join(self.tampering))
        if not self.done or self.ex.exit_code != 0 or self.ex.limit_hit:
            how = (f"limit hit: {self.ex.limit_hit}" if self.ex.limit_hit else
                   f"signal {self.ex.signal}" if self.ex.signal else f"exit status {self.ex.exit_code}")
            return self._fail(f"the program ended before the checker finished ({how}) after {len(self.answers)} "
                              f"of {n} tests: exiting early is a failure")
        passed, failed = 0, []
        for i, test in enumerate(self.tests):
            if self._correct(test, self.answers[i]):
                passed += 1
            else:
                failed.append(i)
        reason = "all tests passed" if not failed else f"{len(failed)} of {n} tests failed (first: #{failed[0]})"
        return CheckVerdict(passed, n, reason, (), self.ex)

    def _fail(self, reason: str) -> CheckVerdict:
        return CheckVerdict(0, len(self.tests), reason, tuple(self.tampering), self.ex)

    def _correct(self, test: HiddenTest, answer: dict) -> bool:
        if test.raises is not None:
            return answer.get("raised") == test.raises
        return "value" in answer and _canonical(answer["value"]) == _canonical(test.expect)

    def _read(self) -> None:
        if self.ex.stdout_truncated:
            self.tampering.append("the reply channel overflowed (the program wrote to it)")
        lines = self.ex.stdout.decode("utf-8", "replace").splitlines()
        try:
            hello = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            hello = None
        if not isinstance(hello, dict) or hello.get("hello") is not True:
            if lines:
                self.tampering.append("the reply channel did not start with the driver's greeting")
            return
        self.pid = hello.get("pid")
        for line in lines[1:]:
            self._line(line)

    def _line(self, line: str) -> None:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            self.tampering.append(f"a line on the reply channel is not the driver's: {line[:80]!r}")
            return
        if self.done or not isinstance(msg, dict):
            self.tampering.append(f"reply after the driver finished or of the wrong shape: {line[:80]!r}")
        elif msg.get("pid") != self.pid:
            self.tampering.append("an answer came from another process than the one that started "
                                  "(the submission forked and the parent exited)")
            self.done = True  # one reason is enough; the rest of the channel is the child's
        elif "import_error" in msg and not self.answers:
            self.import_error = str(msg["import_error"])
        elif "done" in msg:
            if msg["done"] != len(self.tests) or len(self.answers) != len(self.tests):
                self.tampering.append(f"a 'done' record after {len(self.answers)} of {len(self.tests)} answers")
            self.done = True
        elif msg.get("id") != len(self.answers):
            self.tampering.append(f"answer out of order or repeated: {line[:80]!r}")
        elif "not_plain" in msg:
            self.tampering.append(f"test #{msg['id']} returned a {msg['not_plain']!r} object, not plain data "
                                  "(an object that compares equal to anything cannot pass)")
            self.answers[msg["id"]] = msg
        else:
            self.answers[msg["id"]] = msg
