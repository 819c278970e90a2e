"""`rlbus up` stops on held-out accuracy sustained over several rounds, not on one lucky reading."""

from __future__ import annotations

from pathlib import Path

from services.up.monitor import Monitor


def _round(mon: Monitor, version: int, acc: float) -> None:
    mon.evals.append({"kind": "eval", "eval_round": version, "heldout/accuracy": acc})


def test_one_reading_at_the_target_is_not_enough_the_mean_of_the_latest_rounds_is(tmp_path: Path) -> None:
    mon = Monitor(path=tmp_path / "metrics.jsonl", eval_size=200)
    assert mon.sustained_accuracy(3) is None
    for version, acc in [(0, 0.38), (5, 0.84), (10, 0.905)]:
        _round(mon, version, acc)
    # The first 0.905 averages to 0.708 with the two rounds before it: not yet at 0.9.
    assert mon.sustained_accuracy(3) < 0.9
    assert mon.sustained_accuracy(1) == 0.905
    for version, acc in [(15, 0.9), (20, 0.91)]:
        _round(mon, version, acc)
    assert abs(mon.sustained_accuracy(3) - (0.905 + 0.9 + 0.91) / 3) < 1e-12
