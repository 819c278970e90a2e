"""Throughput and stage times of a pipeline run, as JSON.

Reads a run folder written by `rlbus up` (or runs one: `--run N` steps with the default config)
and prints trained samples/s, median time per stage (train step, checkpoint,
weight hand-over, weight propagation) and the trainer idle fraction.

    .venv/bin/python bench/pipeline_bench.py --run 100          # run rlbus up for 100 steps, then report
    .venv/bin/python bench/pipeline_bench.py runs/demo-…         # report on an existing run folder
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rlbus.services.up.monitor import load_metrics


def _events(path: Path, name: str) -> dict[int, float]:
    out: dict[int, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        if d.get("event") == name and "version" in d:
            out[int(d["version"])] = datetime.datetime.fromisoformat(d["timestamp"].replace("Z", "+00:00")).timestamp()
    return out


def _lines(path: Path, name: str) -> list[dict[str, object]]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return [d for d in rows if d.get("event") == name]


GEN_PHASES = ("grant_wait", "take", "env", "sample", "publish")
# Spans a generator logs beside its batches (services/generator/spans.py): the episode engine decoding
# (one-turn episodes by default), and the batch driver finding nothing to take: its admission grant
# used up, its concurrency cap full (groups still playing), or room but no task queued.
SPAN_PHASES = {"episodes_busy": "episodes", "generator_no_grant": "no_grant", "generator_cap_full": "cap_full",
               "generator_no_tasks": "no_tasks"}


def idle_breakdown(logs: Path) -> dict[str, object]:
    """What the trainer waited for: each of its waits (trainer.log ``idle``) laid over what the
    generators were doing at the time (generator-*.log ``batch``: grant wait, task take,
    environment reset, sampling, publishing; outside any batch: nothing in hand; and the spans of
    SPAN_PHASES: the episode engine decoding, which runs beside the batch driver, so its share
    overlaps the others' and the shares can sum past 1, and loop turns that took nothing for want
    of room or of tasks).  Seconds of trainer wait per generator phase, as shares
    of all the wait, and the groups that arrived during the waits by what became of them (``train``,
    ``filtered``, ``stale`` ...)."""
    phases: list[tuple[float, float, str]] = []
    for path in sorted(logs.glob("generator-*.log")):
        for b in _lines(path, "batch"):
            t = float(b["started"])  # type: ignore[arg-type]
            for name in GEN_PHASES:
                d = float(b.get(f"{name}_s", 0.0))  # type: ignore[arg-type]
                phases.append((t, t + d, name))
                t += d
        for event, name in SPAN_PHASES.items():
            for b in _lines(path, event):
                t = float(b["started"])  # type: ignore[arg-type]
                phases.append((t, t + float(b["span_s"]), name))  # type: ignore[arg-type]
    waits = _lines(logs / "trainer.log", "idle")
    seconds = dict.fromkeys((*GEN_PHASES, *SPAN_PHASES.values(), "no_batch"), 0.0)
    arrivals: dict[str, int] = {}
    for w in waits:
        a = float(w["started"])  # type: ignore[arg-type]
        b = a + float(w["wait_s"])  # type: ignore[arg-type]
        covered = 0.0
        for s, e, name in phases:
            overlap = min(b, e) - max(a, s)
            if overlap > 0:
                seconds[name] += overlap
                covered += overlap
        # Several generators can overlap one wait: what no batch covered is "no_batch" only with one.
        seconds["no_batch"] += max(0.0, (b - a) - covered)
        for k, v in w.items():
            if k.startswith("arrived_"):
                arrivals[k.removeprefix("arrived_")] = arrivals.get(k.removeprefix("arrived_"), 0) + int(v)  # type: ignore[call-overload]
    total = sum(float(w["wait_s"]) for w in waits)  # type: ignore[arg-type]
    return {"waits": len(waits), "wait_s_total": round(total, 3),
            "wait_s_median": _median([float(w["wait_s"]) for w in waits]),  # type: ignore[arg-type]
            "share_by_generator_phase": {k: round(v / total, 3) if total else 0.0 for k, v in seconds.items()},
            "groups_arriving_during_waits": arrivals}


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def report(run_dir: Path) -> dict[str, object]:
    rows = load_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    if len(train) < 3:
        raise SystemExit(f"{run_dir}: fewer than 3 trainer steps in metrics.jsonl")
    span = train[-1]["t"] - train[0]["t"]
    samples = sum(r["batch/rollouts_trained"] for r in train[1:])
    logs = run_dir / "logs"
    steps, published = _events(logs / "trainer.log", "step"), _events(logs / "broadcast.log", "weights_published")
    staged = _events(logs / "generator-0.log", "weights_staged")
    last = train[-1]
    return {
        "run_dir": str(run_dir),
        "steps": len(train),
        "trained_samples_per_s": round(samples / span, 2) if span > 0 else None,
        "seconds_per_step": round(span / (len(train) - 1), 4),
        "trainer_idle_fraction": round(last["trainer/idle_fraction"], 4),
        "stage_median_s": {
            "train_step": _median([r["train/step_s"] for r in train]),
            "checkpoint": _median([r["time/checkpoint_s"] for r in train if r["time/checkpoint_s"] > 0]),
            "weight_upload": _median([r["time/weight_upload_s"] for r in train if r["time/weight_upload_s"] > 0]),
            "step_to_weights_published": _median([published[v] - steps[v] for v in steps if v in published]),
            "published_to_generator_staged": _median([staged[v] - published[v] for v in published if v in staged]),
        },
        "generator_tokens_per_s_median": _median([r["generator/tokens_per_s"] for r in train if r["generator/tokens_per_s"]]),
        "groups": {k.split("/")[-1]: last[k] for k in last if k.startswith("trainer/groups_") and not k.endswith("total")},
        "trainer_idle": idle_breakdown(logs),
    }


def with_settings(text: str, settings: list[str], *, flag: str) -> str:
    """The TOML config ``text`` with each ``TABLE.KEY=VALUE`` of ``settings`` written under its
    ``[TABLE]`` (added at the end when the text has none); rlbus's strict config checks the names."""
    for setting in settings:
        key, _, value = setting.partition("=")
        table, _, name = key.rpartition(".")
        if not table or not name or not value:
            raise SystemExit(f"{flag} {setting!r}: write TABLE.KEY=VALUE, e.g. generator.batch_wait_s=0")
        header = f"[{table}]\n"
        if header not in text:
            text = f"{text}{header}{name} = {value}\n"
            continue
        head, _, rest = text.partition(header)
        body, nxt, tail = rest.partition("\n[")
        # A key the base text already sets in that table is replaced, not repeated (TOML refuses a repeat).
        lines = [line for line in body.splitlines() if line.split("=", 1)[0].strip() != name]
        text = head + header + "".join(f"{line}\n" for line in [f"{name} = {value}", *lines]) + nxt.lstrip("\n") + tail
    return text


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--run", type=int, default=0, help="run rlbus up for this many steps first")
    ap.add_argument("--with", dest="extra", action="append", default=[], metavar="TABLE.KEY=VALUE",
                    help="a setting for that run (TOML value), e.g. --with generator.batch_wait_s=0; repeatable")
    args = ap.parse_args()
    if args.run:
        run_dir = Path(tempfile.mkdtemp(prefix="rlbus-bench-")) / "run"
        cfg = run_dir.parent / "bench.toml"
        cfg.write_text(with_settings("[up]\nstop_at_accuracy = 0.0\n[controller]\neval_every = 50\n", args.extra,
                                     flag="--with"))
        subprocess.run([sys.executable, "-m", "rlbus.services.cli",
                        "up", str(cfg), "--steps", str(args.run), "--run-dir",
                        str(run_dir), "--no-view"], check=True, capture_output=True)
    elif args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        ap.error("give a run folder or --run N")
    print(json.dumps(report(run_dir), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
