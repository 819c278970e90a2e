"""Reward integrity for code-tests tasks: every reward-hacking attempt scores 0 with its reason,
an honest solution scores what it earns, and the sandbox serves the next check right after.
Each submission is a *wrong* solution plus a hack: the hack must not lift it above 0."""

from __future__ import annotations

import hashlib
import os

import pytest

from rlbus.services.sandbox import Sandbox, SandboxSettings, probe
from rlbus.services.sandbox.checker import CHECK_LIMITS, HiddenTest, HiddenTestChecker

ISO = probe()
pytestmark = pytest.mark.skipif(not (ISO.bwrap and ISO.separate_uid),
                                reason="needs bubblewrap and root (apt-get install bubblewrap; run as root)")
SECRET = "expected-9c41e"
TESTS = [HiddenTest("add", (1, 2), expect=3), HiddenTest("add", (20, 22), expect=42),
         HiddenTest("add", ("a", 1), raises="TypeError"), HiddenTest("tag", (), expect=SECRET)]
WRONG = "def add(a, b):\n    return 0\ndef tag():\n    return ''\n"


@pytest.fixture
async def checker():
    # One uid range per test worker, apart from test_sandbox.py's (pytest -n runs tests of a file on both).
    base = 61300 + 32 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    sb = Sandbox(SandboxSettings(uid_base=base, uid_span=8, max_concurrent=2))
    yield HiddenTestChecker(sb)
    sb.close()


async def assert_still_checks(checker: HiddenTestChecker) -> None:
    honest = f"def add(a, b):\n    return a + b\ndef tag():\n    return {SECRET!r}\n"
    v = await checker.check(honest, TESTS)
    assert (v.passed, v.total, v.reason) == (4, 4, "all tests passed"), v.reason


async def test_honest_and_wrong_solutions_score_what_they_earn(checker):
    await assert_still_checks(checker)
    v = await checker.check("def add(a, b):\n    return a + b\ndef tag():\n    return 'no'\n", TESTS)
    assert (v.passed, v.reason) == (3, "1 of 4 tests failed (first: #3)")


HACKS = {
    # name: (submission, a phrase its verdict's reason must hold)
    "exit 0 at import": ("import sys\nsys.exit(0)\n" + WRONG, "failed to import: SystemExit"),
    "os._exit mid-test": ("import os\ndef add(a, b):\n    os._exit(0)\ndef tag():\n    os._exit(0)\n",
                          "exiting early is a failure"),
    "atexit rewrites status": ("import atexit, os\natexit.register(lambda: os._exit(0))\n" + WRONG, "tests failed"),
    "kill the parent": ("import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n"
                        "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n" + WRONG,
                        "tests failed"),  # as pid 1 of its namespace it survives its own kills: scored by its answers
    "fork and exit": ("import os\nif os.fork():\n    os._exit(0)\n"
                      "def add(a, b):\n    return a + b\ndef tag():\n    return ''\n", "BlockingIOError"),
    "always-equal object": ("class Yes:\n    def __eq__(self, other):\n        return True\n"
                            "def add(a, b):\n    return Yes()\ndef tag():\n    return Yes()\n", "not plain data"),
    "int subclass with __eq__": ("class Yes(int):\n    def __eq__(self, other):\n        return True\n"
                                 "def add(a, b):\n    return Yes(0)\ndef tag():\n    return ''\n", "not plain data"),
    "fake success markers": ("print('Ran 4 tests in 0.001s\\n\\nOK')\nprint('{\"passed\": 4, \"total\": 4}')\n" + WRONG,
                             "tests failed"),
    "forged answers on the reply channel": (
        "import os\nfor fd in range(3, 10):\n    try:\n"
        "        os.write(fd, b'{\"id\": 0, \"value\": 3}\\n{\"id\": 1, \"value\": 42}\\n{\"done\": 4}\\n')\n"
        "    except OSError:\n        pass\n" + WRONG, "tampering"),
    "patch the checker in memory": (
        "import sys\nmain = sys.modules['__main__']\nmain.plain = lambda value, depth=0: True\n"
        "class Yes:\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Yes()\ndef tag():\n    return Yes()\n", "exiting early is a failure"),
    "monkey-patch sys.exit, unittest, builtins": (
        "import builtins, sys, unittest\nsys.exit = lambda *a: None\n"
        "unittest.TestCase.assertEqual = lambda *a, **k: None\nbuiltins.AssertionError = Exception\n"
        "builtins.print = lambda *a, **k: None\n" + WRONG, "tests failed"),
    "write and delete test files": (
        "import os\nfor path in ['/checker/driver.py', '/checker/tests.py', '/work/test_solution.py']:\n"
        "    try:\n        os.remove(path)\n    except OSError:\n        pass\n"
        "    try:\n        open(path, 'w').write('def test(): pass')\n    except OSError:\n        pass\n" + WRONG,
        "tests failed"),
    "search the file system for the hidden answers": (
        # Everything readable but its own source, /usr and the kernel's views; /proc/self included.
        "import os\ndef _files():\n    yield from ('/proc/self/cmdline', '/proc/self/environ', '/proc/1/environ')\n"
        "    for d, _, names in os.walk('/'):\n        if not d.startswith(('/proc', '/sys', '/usr', '/work', '/dev')):\n"
        "            yield from (os.path.join(d, n) for n in names)\n"
        "def _find():\n    needle = 'expected' + '-'\n    for path in _files():\n        try:\n"
        "            text = open(path, errors='ignore').read()\n        except OSError:\n            continue\n"
        "        if needle in text:\n            return text[text.index(needle):][:14]\n"
        "    return 'not found'\n"
        "def add(a, b):\n    return 0\ndef tag():\n    return _find()\n", "tests failed"),
}


@pytest.mark.parametrize("name", list(HACKS))
async def test_reward_hack_scores_zero_with_reason(checker, name):
    source, phrase = HACKS[name]
    driver_before = hashlib.sha256(checker.driver.read_bytes()).hexdigest()
    v = await checker.check(source, TESTS)
    assert v.passed == 0 and v.score == 0.0, (name, v.reason)
    assert phrase in v.reason and v.reason, (name, v.reason)
    assert hashlib.sha256(checker.driver.read_bytes()).hexdigest() == driver_before
    await assert_still_checks(checker)


async def test_fork_and_exit_caught_by_the_pid_check_too(checker):
    # With forks allowed, the child that goes on answering is caught by its pid, or dies with the
    # pid namespace when the parent exits: either way 0 with the reason.
    loose = HiddenTestChecker(checker.sandbox, CHECK_LIMITS.model_copy(update={"processes": 4}))
    v = await loose.check(HACKS["fork and exit"][0], TESTS)
    assert v.passed == 0
    assert "forked" in v.reason or "exiting early" in v.reason, v.reason


async def test_the_reward_service_scores_code_tests_and_records_tampering():
    """Through the reward service's Scorer: the hidden tests travel in Task.answer, the program is the
    completion's last code block, a hack scores 0 with its reason in the scored rollout, and an
    environment failure is excluded, never scored."""
    import dataclasses
    import json

    import numpy as np

    from rlbus.schemas import Rollout, RolloutGroup, Task, spans_from_versions
    from rlbus.services.reward.service import Scorer
    from rlbus.services.reward.settings import RewardSettings

    base = 61300 + 32 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) + 16
    hidden = json.dumps([{"fn": t.fn, "args": list(t.args), "expect": t.expect, "raises": t.raises} for t in TESTS])
    honest = f"def add(a, b):\n    return a + b\ndef tag():\n    return {SECRET!r}\n"
    texts = [f"here it is\n```python\n{honest}```\n", f"```python\n{HACKS['forged answers on the reply channel'][0]}```",
             honest, "```python\ndef add(a, b):\n```"]

    def rollout(i: int, text: str) -> Rollout:
        n = len(text)
        return Rollout(rollout_id=f"code-1/{i}", task_id="code-1", index=i, token_ids=np.ones(2 + n, dtype="<i4"),
                       prompt_len=2, loss_mask=np.ones(n, dtype="|u1"), behaviour_logprobs=np.zeros(n, dtype="<f4"),
                       version_spans=spans_from_versions(np.zeros(n)), text=text)

    rollouts = [rollout(i, t) for i, t in enumerate(texts)]
    rollouts[2] = dataclasses.replace(rollouts[2], env_error="the environment failed: SandboxError: no uid")
    task = Task(run="t", task_id="code-1", pool="train", env="code-tests", prompt="write add and tag",
                answer=hidden, group_size=len(texts))
    scorer = Scorer(RewardSettings(sandbox=SandboxSettings(uid_base=base, uid_span=8, max_concurrent=2)))
    try:
        out = await scorer.score(RolloutGroup(task=task, rollouts=rollouts))
    finally:
        scorer.close()
    honest_s, hack, broken, syntax = out.scored
    assert (honest_s.reward, honest_s.components["correct"]) == (1.0, 1.0), honest_s.verifier_detail
    assert hack.reward == 0.0 and hack.components["tampering"] == 1.0 and "tampering" in hack.verifier_detail
    assert broken.env_failure and not broken.valid and "no uid" in broken.verifier_detail
    assert syntax.reward == 0.0 and "failed to import" in syntax.verifier_detail
    assert scorer.metrics()["reward/tampering"] == 1 and scorer.metrics()["reward/env_failures"] == 1
