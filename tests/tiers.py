"""The test tiers, in the order CI runs them: ``python -m tests.tiers`` (what ``make test`` runs).

1. ``fast``: no model build, no server (unit tests, the in-memory bus, static deploy checks).  A
   failure here stops the run: nothing slower is worth waiting for.
2. ``docs``: ``mkdocs build --strict`` (a broken link or a page missing from the nav fails it).
3. ``integration``: a real nats-server, subprocesses, the bubblewrap sandbox.
4. ``model``: tests that need the warm-started tiny model, whole runs (``slow``), vLLM engines.

A test of tiers 3-4 that fails is run once more, alone.  If it passes then, the run still passes, but
the test is printed under FLAKY at the end: each one is a bug (a race, a timing assumption, a leak
between tests) to be found and fixed, not a pass.  The run ends with one line per tier (tests, seconds,
outcome), the FLAKY list and a closing ``ci: N passed, N failed`` line.

Tiers are chosen by markers that tests/conftest.py sets from what a test needs (its fixtures and its
folder), so a new test lands in the right tier without anyone remembering a marker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SLOW = "model or integration or slow or vllm or gpu"
# The pytest options every tier shares: two workers, one test at a time each (most slow tests wait on
# services, so a second worker fills that time; tests/conftest.py orders the tests for it).
WORKERS = ["-n", "2", "--maxschedchunk", "1"]


@dataclass(frozen=True)
class Tier:
    name: str
    markers: str  # a pytest -m expression; "" for a tier that is not pytest
    rerun: bool  # failures are run once more and reported FLAKY if they pass then
    stop_on_failure: bool


TIERS = (
    Tier("fast", f"not ({SLOW})", rerun=False, stop_on_failure=True),
    Tier("docs", "", rerun=False, stop_on_failure=True),
    Tier("integration", "integration and not (model or slow or vllm or gpu)", rerun=True, stop_on_failure=False),
    Tier("model", "(model or slow or vllm) and not gpu", rerun=True, stop_on_failure=False),
)


@dataclass
class Outcome:
    """What one pytest run reported (through the ``Recorder`` plugin below)."""

    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: int = 0
    exit_code: int = 0
    seconds: float = 0.0

    @classmethod
    def read(cls, path: Path, exit_code: int, seconds: float) -> Outcome:
        out = cls(exit_code=exit_code, seconds=seconds)
        if path.exists():
            data = json.loads(path.read_text() or "{}")
            out.passed, out.skipped = data.get("passed", 0), data.get("skipped", 0)
            out.failed = sorted(data.get("failed", []))
        return out

    @property
    def ok(self) -> bool:
        # 5: nothing selected (a tier can be empty where a tool is missing); anything else with no
        # failed test recorded (an interrupted run, a collection error) is a failure of the tier.
        return not self.failed and self.exit_code in (0, 5)


class Recorder:
    """A pytest plugin (``-p tests.tiers``) that writes the node ids of failed tests and the counts to
    the file named by ``RLBUS_TIER_REPORT``.  It runs in the controller under pytest-xdist, which
    replays every worker's reports there."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.passed: set[str] = set()
        self.failed: set[str] = set()
        self.skipped: set[str] = set()

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failed.add(report.nodeid)
        elif report.skipped:
            self.skipped.add(report.nodeid)
        elif report.when == "call" and report.passed:
            self.passed.add(report.nodeid)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.failed.add(report.nodeid or "<collection>")

    def pytest_sessionfinish(self, session: Any) -> None:
        passed = self.passed - self.failed - self.skipped
        self.path.write_text(json.dumps({"passed": len(passed), "skipped": len(self.skipped - self.failed),
                                         "failed": sorted(self.failed)}))


def pytest_configure(config: Any) -> None:
    report = os.environ.get("RLBUS_TIER_REPORT")
    if report and not hasattr(config, "workerinput"):  # the controller only; workers send it reports
        config.pluginmanager.register(Recorder(Path(report)), "rlbus-tier-recorder")


def run_pytest(args: list[str], report: Path) -> Outcome:
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.tiers", *args]
    print("$", " ".join(cmd[2:]), flush=True)
    start = time.monotonic()
    code = subprocess.call(cmd, cwd=ROOT, env={**os.environ, "RLBUS_TIER_REPORT": str(report)})
    return Outcome.read(report, code, time.monotonic() - start)


def run_docs() -> Outcome:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        print("mkdocs is not installed: install the dev extra (pip install -e '.[dev]')", flush=True)
        return Outcome(failed=["docs: mkdocs missing"], exit_code=1)
    with tempfile.TemporaryDirectory() as site:
        # Not --quiet: it silences the warnings that --strict counts, and the build then always passes.
        cmd = [mkdocs, "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", site]
        print("$ mkdocs build --strict", flush=True)
        start = time.monotonic()
        # NO_MKDOCS_2_WARNING: mkdocs-material's banner about a future MkDocs, not about these docs.
        code = subprocess.call(cmd, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    return Outcome(passed=int(code == 0), failed=[] if code == 0 else ["docs: mkdocs build --strict"],
                   exit_code=code, seconds=time.monotonic() - start)


@dataclass
class TierResult:
    tier: Tier
    outcome: Outcome
    flaky: list[str] = field(default_factory=list)
    rerun_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome.ok


def run_tier(tier: Tier, extra: list[str], workdir: Path) -> TierResult:
    print(f"\n===== tier {tier.name} =====", flush=True)
    if not tier.markers:
        return TierResult(tier, run_docs())
    report = workdir / f"{tier.name}.json"
    first = run_pytest([*WORKERS, "-m", tier.markers, *extra], report)
    result = TierResult(tier, first)
    if first.ok or not tier.rerun or not first.failed or first.exit_code not in (0, 1):
        return result  # a collection error or an interrupted run is not a flake to retry
    print(f"\n----- tier {tier.name}: running {len(first.failed)} failed test(s) once more, one at a time -----",
          flush=True)
    again = run_pytest([*first.failed], workdir / f"{tier.name}-rerun.json")
    result.rerun_seconds = again.seconds
    still = set(again.failed) | (set(first.failed) if again.exit_code not in (0, 1) else set())
    result.flaky = [t for t in first.failed if t not in still]
    result.outcome = Outcome(passed=first.passed + len(result.flaky), failed=sorted(still),
                             skipped=first.skipped, exit_code=0 if not still else 1, seconds=first.seconds)
    return result


def summary(results: list[TierResult], skipped_tiers: list[str]) -> int:
    print("\n===== summary =====")
    for r in results:
        o = r.outcome
        rerun = f" (+{r.rerun_seconds:.0f} s rerun)" if r.rerun_seconds else ""
        print(f"tier {r.tier.name:<12} {'ok' if r.ok else 'FAILED':<7} {o.passed:>5} passed {len(o.failed):>3} failed "
              f"{o.skipped:>3} skipped  {o.seconds:7.0f} s{rerun}")
    for name in skipped_tiers:
        print(f"tier {name:<12} not run (an earlier tier failed)")
    flaky = [t for r in results for t in r.flaky]
    print(f"FLAKY ({len(flaky)}): each passed only when run again; each is a bug to fix")
    for t in flaky:
        print(f"  FLAKY {t}")
    failed = [t for r in results for t in r.outcome.failed]
    for t in failed:
        print(f"  FAILED {t}")
    total = sum(r.outcome.seconds + r.rerun_seconds for r in results)
    print(f"total {total:.0f} s")
    passed = sum(r.outcome.passed for r in results)
    skipped = sum(r.outcome.skipped for r in results)
    print(f"ci: {passed} passed, {len(failed)} failed, {skipped} skipped")
    ok = all(r.ok for r in results) and not skipped_tiers
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", action="append", choices=[t.name for t in TIERS],
                        help="run only these tiers (repeatable); default: all, in order")
    parser.add_argument("pytest_args", nargs="*", help="passed to every pytest tier (after --)")
    args = parser.parse_args(argv)
    chosen = [t for t in TIERS if not args.tier or t.name in args.tier]
    results: list[TierResult] = []
    with tempfile.TemporaryDirectory(prefix="rlbus-tiers-") as tmp:
        for i, tier in enumerate(chosen):
            result = run_tier(tier, args.pytest_args, Path(tmp))
            results.append(result)
            if not result.ok and tier.stop_on_failure:
                return summary(results, [t.name for t in chosen[i + 1:]])
    return summary(results, [])


if __name__ == "__main__":
    sys.exit(main())
