"""Bounded staleness when generators outpace the trainer: no trained sample is ever older than
max_staleness versions, and every group the trainer refused is recorded with its reason."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.harness import checkpoint_state, run_up

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_staleness_bound_holds_with_a_slow_trainer(tiny_model: Path, tmp_path: Path) -> None:
    # The trainer's deterministic (one sequence per forward) path is ~15x slower than the
    # generator's batched sampling: the generators are far faster than the trainer.
    run_dir, rows = run_up(tmp_path, f"""
[run]
run = "stale"
model_path = "{tiny_model}"
group_size = 4
batch_groups = 8
max_staleness = 1

[trainer]
deterministic = true
checkpoint_every = 1

[up]
train_tasks = 600
eval_tasks = 0
max_steps = 8
generators = 2
""", timeout=600)
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) >= 8
    assert max(r["staleness/max"] for r in train) <= 1, [r["staleness/max"] for r in train]
    # The generators were ahead: most batches hold samples one version old.
    assert sum(r["staleness/hist_1"] for r in train) > 0
    ledger = Counter(checkpoint_state(run_dir)["consumed"].values())
    counters = checkpoint_state(run_dir)["counters"]
    assert ledger["train"] == counters["groups_trained_total"] >= 8 * 8
    assert set(ledger) <= {"train", "filtered", "stale", "invalid", "duplicate"}, ledger
