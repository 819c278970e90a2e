"""The real-model job as a benchmark: held-out accuracy over versions and where a step's time goes.

Runs `rlbus up --model smollm2-135m-instruct --task reasoning-gym:<dataset>` once per seed (and per
backend), or reads run folders that already exist, and prints one JSON object: per run the held-out
curve at its pinned versions, the gain from version 0, seconds to each held-out round, and the medians
of a step's parts (trainer forward/backward, weight upload, the generator's fetch of each version,
generator tokens/s); then the spread over runs.

    python bench/real_model.py --seeds 0 1 2 --steps 120            # three runs, the default recipe
    python bench/real_model.py --backend vllm --seeds 0 --steps 60  # the vLLM generator
    python bench/real_model.py --summarise runs/real-a runs/real-b  # figures of finished runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarise(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    fetch = []
    for log in sorted((run_dir / "logs").glob("generator-*.log")):
        for line in log.read_text().splitlines():
            if '"weights_staged"' in line:
                fetch.append(float(json.loads(line).get("fetch_s", 0.0)))
    curve = [{"version": e["eval_round"], "accuracy": e["heldout/accuracy"], "t": round(e["t"], 1), "n": e.get("n")}
             for e in evals]
    first = curve[0]["accuracy"] if curve else None
    last2 = [c["accuracy"] for c in curve[-2:]]
    gaps = [b["t"] - a["t"] for a, b in zip(train, train[1:], strict=False)]
    resolved = run_dir / "config.toml"  # the config every service of the run read
    backend = tomllib.loads(resolved.read_text())["generator"]["backend"] if resolved.exists() else "unknown"
    return {
        "run_dir": str(run_dir), "backend": backend, "steps": len(train),
        "seconds": round(train[-1]["t"], 1) if train else None,
        "heldout": curve,
        "heldout_gain_last2": round(sum(last2) / len(last2) - first, 3) if curve and first is not None else None,
        "median_s": {
            "step_wall": _median(gaps),
            "trainer_forward_backward": _median([r["train/step_s"] for r in train]),
            "weight_upload": _median([r.get("time/weight_upload_s", 0.0) for r in train[1:]]),
            "generator_fetch_per_version": _median(fetch),
        },
        "generator_tokens_per_s": _median([r["generator/tokens_per_s"] for r in train]),
        "trainer_idle_fraction_end": round(train[-1]["trainer/idle_fraction"], 3) if train else None,
        "groups_filtered_share": round(train[-1]["trainer/groups_filtered"] / max(
            1.0, train[-1]["trainer/groups_filtered"] + train[-1]["trainer/groups_train"]), 3) if train else None,
        "mismatch_fresh_k3_median": _median([r["mismatch_fresh/k3_kl"] for r in train if "mismatch_fresh/k3_kl" in r]),
    }


def run(seed: int, steps: int, dataset: str, backend: str, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    config = out.with_suffix(".toml")
    config.write_text(f"[up]\nseed = {seed}\n")
    cmd = [sys.executable, "-m", "rlbus.services.cli", "up", str(config), "--model", "smollm2-135m-instruct",
           "--task", f"reasoning-gym:{dataset}", "--steps", str(steps), "--backend", backend, "--run-dir", str(out),
           "--no-view"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="*", default=[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--dataset", default="chain_sum")
    p.add_argument("--backend", choices=["torch", "vllm"], default="torch")
    p.add_argument("--out", default="runs/bench-real", help="folder of the run folders")
    p.add_argument("--summarise", nargs="*", default=None, metavar="RUN_DIR", help="only read these run folders")
    args = p.parse_args()
    if args.summarise:
        dirs = [Path(d) for d in args.summarise]
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dirs = [run(s, args.steps, args.dataset, args.backend, Path(args.out) / f"{args.backend}-s{s}-{stamp}")
                for s in args.seeds]
    runs = [summarise(d) for d in dirs]
    gains = [r["heldout_gain_last2"] for r in runs if r["heldout_gain_last2"] is not None]
    print(json.dumps({"runs": runs, "heldout_gain_last2": {"min": min(gains, default=None), "max": max(gains, default=None),
                                                         "median": _median(gains)}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
