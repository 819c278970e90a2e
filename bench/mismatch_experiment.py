"""Inject a known training–inference mismatch and compare corrections (training–inference consistency;
results: docs/measurements/mismatch-injected-cpu2-2026-12-02.md).

Runs `rlbus up` several times from the same warm-start policy: generator in bfloat16, trainer in
float32 (a real precision gap), with `[trainer.objective] correction` = none, tis (truncated IS, the default) and mis
(masked IS); plus a float32 baseline.  Prints one JSON object with, per run, final held-out
accuracy, mean k3 KL, mean |Δ logprob|, ESS and the wall time; writes `mismatch.png`.

    .venv/bin/python bench/mismatch_experiment.py --steps 150 --out runs/mismatch
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from rlbus.services.up.monitor import load_metrics

RUNS = {
    "fp32 (no gap), tis": {"generator": {"dtype": "float32"}, "trainer.objective": {"correction": "tis"}},
    "bf16 gen, none": {"generator": {"dtype": "bfloat16"}, "trainer.objective": {"correction": "none"}},
    "bf16 gen, tis": {"generator": {"dtype": "bfloat16"}, "trainer.objective": {"correction": "tis"}},
    "bf16 gen, mis": {"generator": {"dtype": "bfloat16"}, "trainer.objective": {"correction": "mis"}},
}


def _toml(model: str, steps: int, extra: dict[str, dict[str, object]], lr: float) -> str:
    tables: dict[str, dict[str, object]] = {
        "run": {"run": "mismatch", "model_path": model, "batch_groups": 32, "group_size": 8},
        "up": {"max_steps": steps, "stop_at_accuracy": 0.0, "eval_tasks": 200},
        "controller": {"eval_every": 20},
        "trainer": {"lr": lr},
    }
    for table, values in extra.items():
        tables.setdefault(table, {}).update(values)
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/tiny-addition")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="runs/mismatch")
    ap.add_argument("--only", nargs="*", default=None, help="subset of run names")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, extra in RUNS.items():
        if args.only and name not in args.only:
            continue
        slug = name.replace(" ", "").replace(",", "_").replace("(", "").replace(")", "")
        cfg = out / f"{slug}.toml"
        cfg.write_text(_toml(args.model, args.steps, extra, args.lr))
        run_dir = out / slug
        proc = subprocess.run([sys.executable, "-m", "rlbus.services.cli", "up", str(cfg), "--run-dir", str(run_dir),
                               "--no-view"], capture_output=True, text=True)
        rows = load_metrics(run_dir / "metrics.jsonl")
        train = [r for r in rows if r["kind"] == "train"]
        evals = [r for r in rows if r["kind"] == "eval"]
        results[name] = {
            "exit": proc.returncode,
            "error": proc.stderr[-400:] if proc.returncode else "",
            "steps": len(train),
            "heldout_first": evals[0]["heldout/accuracy"] if evals else None,
            "heldout_final": evals[-1]["heldout/accuracy"] if evals else None,
            "k3_kl_mean": statistics.fmean(r["mismatch/k3_kl"] for r in train) if train else None,
            "abs_diff_mean": statistics.fmean(r["mismatch/abs_diff_mean"] for r in train) if train else None,
            "ess_mean": statistics.fmean(r["mismatch/ess"] for r in train) if train else None,
            "fresh_abs_diff_mean": _mean(train, "mismatch_fresh/abs_diff_mean"),
            "fresh_k3_kl_mean": _mean(train, "mismatch_fresh/k3_kl"),
            "truncated_frac_mean": statistics.fmean(r["mismatch/truncated_frac"] for r in train) if train else None,
            "wall_s": train[-1]["t"] if train else None,
            "curve": [(r["t"], r["heldout/accuracy"]) for r in evals],
        }
    _plot(results, out / "mismatch.png")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "curve"} for k, v in results.items()}, indent=1))
    return 0


def _mean(rows: list[dict[str, float]], key: str) -> float | None:
    """Mean of a metric over the steps that have it (fresh-sample metrics need fresh samples)."""
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else None


def _plot(results: dict[str, dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        curve = r["curve"]
        if curve:
            ax.plot([t for t, _ in curve], [a for _, a in curve], "o-", label=name)  # type: ignore[union-attr]
    ax.set_xlabel("seconds")
    ax.set_ylabel("held-out accuracy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    sys.exit(main())
