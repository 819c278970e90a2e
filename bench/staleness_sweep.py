"""The staleness bound's price and payoff: `rlbus up` at several `max_staleness`, same seed and budget.

A tighter bound keeps samples fresher but makes the trainer wait for the generator's next batch
(at s = 1 the generator may start batch V + 1 only once weights V exist, so weight hand-over and
generation race the trainer's step); a looser one lets generation run ahead.  For each bound this
runs the default job for `--steps` trainer steps (held-out evaluation every 10 versions, no early
stop) and prints, as one JSON object: seconds per step, trainer idle fraction, staleness of what
was trained (mean, max), stale drops, and held-out accuracy against both steps and seconds, so
the bound's cost in sample efficiency and its gain in wall clock are read side by side.

    .venv/bin/python -m bench.staleness_sweep --bounds 1 2 --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.pipeline_bench import report
from rlbus.services.up.monitor import load_metrics


def one(bound: int, steps: int, root: Path) -> dict[str, object]:
    run_dir = root / f"s{bound}"
    cfg = root / f"s{bound}.toml"
    cfg.write_text(f"[run]\nmax_staleness = {bound}\n[up]\nstop_at_accuracy = 0.0\n[controller]\neval_every = 10\n")
    subprocess.run([sys.executable, "-m", "rlbus.services.cli", "up", str(cfg), "--steps", str(steps), "--run-dir",
                    str(run_dir), "--no-view"], check=True, capture_output=True)
    rows = load_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    t_first = train[0]["t"] if train else 0.0
    stats = report(run_dir)
    return {
        "max_staleness": bound,
        "seconds_per_step": stats["seconds_per_step"],
        "trainer_idle_fraction": stats["trainer_idle_fraction"],
        "train_step_median_s": stats["stage_median_s"]["train_step"],  # type: ignore[index]
        "staleness_mean": round(statistics.fmean(r["staleness/mean"] for r in train), 3),
        "staleness_max": max(r["staleness/max"] for r in train),
        "groups": stats["groups"],
        # (trainer step, seconds since the first step, accuracy) per evaluation round.
        "heldout": [(r["trainer_step"], round(r["t"] - t_first, 1), round(r["heldout/accuracy"], 3)) for r in evals],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bounds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlbus-staleness-"))
    out = {"bench": "staleness_sweep", "steps": args.steps, "runs": [one(b, args.steps, root) for b in args.bounds]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
