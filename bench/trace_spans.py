"""Spans a short ``rlbus up`` run exports, counted by an OTLP receiver in this process, as JSON.

Runs ``rlbus up`` (every service a real process) with ``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing
here for ``--seconds``, interrupts it (the services stop on SIGTERM and flush their spans), and
prints the span and trace counts by service and by span name (digits folded), so the cost of
tracing a run can be compared between two checkouts:

    .venv/bin/python bench/trace_spans.py --model tests/.cache/tiny-addition-… --seconds 60
    .venv/bin/python bench/trace_spans.py --model … --seconds 60 --code /path/to/other/checkout

``--code`` runs the services of another checkout (its ``services``/``bus``), still counted here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.otlp import OtlpReceiver  # noqa: E402 - after the path that finds it

CONFIG = """
[run]
run = "spans"
model_path = "{model}"
group_size = 8
batch_groups = 8

[up]
train_tasks = 2000
eval_tasks = 50
max_steps = 100000
generators = 2
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a model folder (the tests' tiny model will do)")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the run goes before it is interrupted")
    ap.add_argument("--code", default=str(ROOT), help="checkout whose services run")
    args = ap.parse_args()
    code = Path(args.code).resolve()
    with OtlpReceiver() as receiver, tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "run.toml"
        config.write_text(CONFIG.format(model=Path(args.model).resolve()))
        env = {**os.environ, "PYTHONPATH": str(code), "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        proc = subprocess.Popen([sys.executable, "-m", "rlbus.services.cli", "up", str(config), "--run-dir",
                                 str(Path(tmp) / "run"), "--no-view"], cwd=code, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(args.seconds)
        proc.send_signal(signal.SIGINT)  # rlbus up stops its services with SIGTERM
        proc.wait(timeout=120)
        time.sleep(1.0)
        spans = receiver.snapshot()
        steps = sum(1 for s in spans if s.name.startswith("train step"))
    print(json.dumps({
        "code": str(code), "seconds": args.seconds, "spans": len(spans),
        "traces": len({s.trace_id for s in spans}), "trainer_step_spans": steps,
        # heartbeats, control decisions, status: spans no one looks for a rollout in
        "periodic_spans": sum(1 for s in spans if re.search(r"\.(metrics|control|status)\.", s.name)),
        "groups_scored": sum(1 for s in spans if s.name.startswith("process ") and ".rollouts." in s.name),
        "by_service": dict(Counter(s.service for s in spans).most_common()),
        "by_name": dict(Counter(re.sub(r"[\d.-]+\d", "N", s.name) for s in spans).most_common(15)),
    }, indent=1))


if __name__ == "__main__":
    main()
