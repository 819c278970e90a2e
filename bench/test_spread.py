"""The spread of the statistics end-to-end tests assert, over repeated runs on this machine.

CI shares two cores with other work, so a threshold must sit outside the spread a statistic shows
here, with and without a second CPU-heavy process beside it.  This reruns the chosen tests, each
recording what it asserts (``tests/e2e/harness.record_stat``), optionally with a CPU burner
beside them, and prints per statistic: runs, min, median, max and the threshold.

    python bench/test_spread.py tests/e2e/test_learning.py --runs 3 --load
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

BURN = "import time\nwhile True:\n    sum(i * i for i in range(100_000))\n"


def run(tests: list[str], runs: int, load: bool, out: Path) -> list[int]:
    codes = []
    for _ in range(runs):
        burner = subprocess.Popen([sys.executable, "-c", BURN]) if load else None
        try:
            env = {**os.environ, "RLBUS_TEST_STATS": str(out), "RLBUS_TEST_LOAD": "loaded" if load else "quiet"}
            codes.append(subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                        env=env).returncode)
        finally:
            if burner is not None:
                burner.kill()
                burner.wait()
    return codes


def summarise(path: Path) -> list[dict[str, object]]:
    by: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    thresholds: dict[tuple[str, str], str] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        by[(row["test"], row["stat"], row["loaded"])].append(row["value"])
        thresholds[(row["test"], row["stat"])] = row["threshold"]
    return [{"test": t, "stat": s, "load": load, "runs": len(v), "min": min(v), "median": statistics.median(v),
             "max": max(v), "threshold": thresholds[(t, s)]} for (t, s, load), v in sorted(by.items())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tests", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--load", action="store_true", help="a CPU-burning process beside each run")
    ap.add_argument("--stats", default="", help="append to this file (default: a temporary one)")
    args = ap.parse_args()
    out = Path(args.stats or tempfile.mkstemp(suffix=".jsonl")[1])
    codes = run(args.tests, args.runs, args.load, out)
    print(json.dumps({"exit_codes": codes, "stats_file": str(out), "summary": summarise(out)}, indent=1))
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
