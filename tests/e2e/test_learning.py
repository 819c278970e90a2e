"""The main job learns: a shortened `rlbus up` (every service a real process on a real
nats-server) must raise held-out accuracy and batch reward by a clear margin."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.services.runtime.config import RunSettings
from tests.e2e.harness import record_stat, run_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_rlbus_up_learns_addition(tiny_model: Path, tmp_path: Path) -> None:
    run_dir, rows = run_up(tmp_path, f"""
[run]
run = "learn"
model_path = "{tiny_model}"
group_size = 8

[up]
train_tasks = 3000
eval_tasks = 200
max_steps = 160

[controller]
eval_every = 20
""", timeout=900)
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) >= 160
    assert evals[0]["eval_round"] == 0 and evals[-1]["eval_round"] >= 160, evals
    # Every round was scored on exactly the version it was scheduled at, while training moved on.
    assert all(e["pinned"] and e["versions"] == [e["eval_round"]] for e in evals), evals
    # One 200-task round has ~0.035 standard error and an asynchronous run's trajectory varies
    # with machine load: judge the mean of the last two rounds, not a single reading.
    first = evals[0]["heldout/accuracy"]
    last = sum(e["heldout/accuracy"] for e in evals[-2:]) / 2
    record_stat("learning", "heldout_gain", last - first, threshold=">= 0.08")
    # Spread (bench/test_spread.py tests/e2e/test_learning.py, 2026-12-06, the warm start this
    # machine's libraries build: 755 supervised steps to 0.385, which learns more slowly per step
    # than the 615-step build the first thresholds were measured on; 80 steps then gained only
    # 0.08-0.14, hence 160): 3 runs beside a CPU burner, held-out gain 0.173-0.185 and batch reward
    # gain 0.214-0.234; 2 quiet runs, 0.147 and 0.205 (reward 0.199). Two 200-task rounds average
    # to a standard error of ~0.025, so 0.08 sits ~2.7 of them below the lowest gain seen.
    assert last >= first + 0.08, f"held-out accuracy {first:.3f} -> {last:.3f}: no clear learning"
    early = sum(r["batch/reward_mean"] for r in train[:10]) / 10
    late = sum(r["batch/reward_mean"] for r in train[-10:]) / 10
    record_stat("learning", "reward_gain", late - early, threshold=">= 0.1")
    assert late >= early + 0.1, f"batch reward {early:.3f} -> {late:.3f}"
    # The trained policy is a Hugging Face folder transformers loads, and the report exists.
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "final_policy", local_files_only=True)
    assert (run_dir / "report.png").stat().st_size > 10_000
    # Staleness never exceeded the run's bound (the default) in any trained batch.
    bound = RunSettings().max_staleness
    assert max(r["staleness/max"] for r in train) <= bound
