"""The multi-turn main job learns: a shortened `rlbus up --task calculator` (every service a real
process on a real nats-server, episodes played by the generator's episode driver against the
calculator environment) must raise held-out accuracy by a clear margin, with episodes that use the
tool (a tool turn, then the final answer: two policy turns or more)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import record_stat, run_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]

# Spread of the held-out gain (mean of the last two rounds minus the first). The warm start is built
# on the machine that runs the tests and comes out different on another host (other kernels, other
# trajectory), and so does how fast RL moves it:
# - 2026-12-05's build, 40 steps: 0.43, 0.55, 0.43, 0.54 beside other test runs, 0.505 and 0.535
#   beside a CPU burner (bench/test_spread.py --load);
# - 2026-12-07's build (232 warm-start steps, held-out 0.335 at the start): 40 steps gave 0.035, 0.065,
#   0.145 and 0.14 (it failed the old margin of 0.25 at 40 steps, old code and new alike); 60 steps
#   gave 0.26, 0.18, 0.25 quiet (it climbs to ~0.57 by step 70 and levels off there).
# So 60 steps and a margin of 0.1, about half the lowest gain measured on either build.
MARGIN = 0.1


def test_rlbus_up_learns_calculator(calculator_model: Path, tmp_path: Path) -> None:
    run_dir, rows = run_up(tmp_path, f"""
[run]
run = "calc"
model_path = "{calculator_model}"
group_size = 8
batch_groups = 16

[up]
task = "calculator"
train_tasks = 2000
eval_tasks = 100
max_steps = 60
stop_at_accuracy = 0

[controller]
eval_every = 10
""", timeout=900)
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) >= 60
    assert evals[0]["eval_round"] == 0 and evals[-1]["eval_round"] >= 60, evals
    # Most episodes are two turns or more (a tool call, then the answer), in training and in evaluation.
    multi = sum(r["batch/multi_turn"] for r in train) / len(train)
    assert multi >= 0.75, f"only {multi:.2f} of trained episodes took two turns or more"
    assert all(e["heldout/turns_mean"] >= 1.9 for e in evals), evals
    first = evals[0]["heldout/accuracy"]
    last = sum(e["heldout/accuracy"] for e in evals[-2:]) / 2
    record_stat("learning_calculator", "heldout_gain", last - first, threshold=f">= {MARGIN}")
    assert last >= first + MARGIN, f"held-out accuracy {first:.3f} -> {last:.3f}: no clear learning"
    assert (run_dir / "report.png").stat().st_size > 10_000
