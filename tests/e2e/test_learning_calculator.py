"""The multi-turn main job learns: a shortened `rlbus up --task calculator` (every service a real
process on a real nats-server, episodes played by the generator's episode driver against the
calculator environment) must raise held-out accuracy by a clear margin, with episodes that use the
tool (a tool turn, then the final answer: two policy turns or more)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import record_stat, run_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]

# The run stops once the mean of the last two held-out rounds reaches 0.6 (200 steps at most) and
# asserts a gain of MARGIN over the first round.  The warm start is built on the machine that runs
# the tests and comes out different on another host, and so does how fast RL moves it:
# - 2026-12-05's build gained 0.43-0.55 in 40 steps (four runs; 0.505 and 0.535 beside a CPU burner);
# - 2026-12-07's build (232 warm-start steps, held-out 0.33) climbs in steps, not smoothly: quiet,
#   0.33 -> 0.43 (30) -> 0.52 (40) -> 0.58 (60) -> 0.61 (90), stopped at 91 steps, gain 0.275; beside
#   a CPU spinner 0.33 -> 0.59 (70) -> 0.51 (90) -> 0.77 (100), stopped at 100, gain 0.31; one
#   150-step run (200 held-out tasks) sat at 0.59-0.61 from version 70 to 120 before 0.73 (130) and
#   0.97 (150).  At a fixed 60 steps its gain was 0.095-0.26 (CI failed a margin of 0.1 there).
# So: stop at 0.6 (a gain of ~0.27 on that build) and fail below a gain of 0.15 by step 200, about
# twice the steps either run needed.  0.15, not more: a warm start stops at its first reading of 0.3
# or above, and one that overshoots to ~0.45 (the jump is abrupt) still has 0.15 below the stop.
MARGIN = 0.15


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
max_steps = 200
stop_at_accuracy = 0.6
stop_rounds = 2

[controller]
eval_every = 10
""", timeout=1500)
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    assert evals[0]["eval_round"] == 0 and len(evals) >= 3, evals
    # Most episodes are two turns or more (a tool call, then the answer), in training and in evaluation.
    multi = sum(r["batch/multi_turn"] for r in train) / len(train)
    assert multi >= 0.75, f"only {multi:.2f} of trained episodes took two turns or more"
    assert all(e["heldout/turns_mean"] >= 1.9 for e in evals), evals
    first = evals[0]["heldout/accuracy"]
    last = sum(e["heldout/accuracy"] for e in evals[-2:]) / 2
    record_stat("learning_calculator", "heldout_gain", last - first, threshold=f">= {MARGIN}")
    record_stat("learning_calculator", "steps", len(train), threshold="<= 200")
    assert last >= first + MARGIN, f"held-out accuracy {first:.3f} -> {last:.3f}: no clear learning"
    assert (run_dir / "report.png").stat().st_size > 10_000
