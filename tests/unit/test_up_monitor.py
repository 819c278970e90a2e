"""`rlbus up` stops on held-out accuracy sustained over several rounds, not on one lucky reading."""

from __future__ import annotations

from pathlib import Path

from rlbus.services.up.monitor import Monitor


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


def test_a_train_row_carries_the_speculators_metrics_and_the_stalest_draft(tmp_path: Path) -> None:
    from rlbus.schemas import Heartbeat
    from rlbus.schemas.metric_keys import DraftKeys, SpeculatorKeys

    mon = Monitor(path=tmp_path / "metrics.jsonl", eval_size=200)
    for gen, lag in (("gen-0", 1.0), ("gen-1", 4.0)):
        mon.on_heartbeat(Heartbeat(service="generator", instance=gen, seq=1, ts=1.0, version=6,
                                   metrics={DraftKeys.VERSION_LAG: lag}))
    mon.on_heartbeat(Heartbeat(service="speculator", instance="speculator-0", seq=1, ts=1.0, version=6,
                               metrics={SpeculatorKeys.PUBLISHED_VERSION: 3.0, SpeculatorKeys.LOSS: 1.25}))
    row = mon.on_heartbeat(Heartbeat(service="trainer", instance="trainer-0", seq=1, ts=1.0, version=6,
                                     metrics={"trainer/step": 6.0, "train/step_s": 0.1}))
    assert row is not None and row[DraftKeys.VERSION_LAG] == 4.0
    assert row[SpeculatorKeys.PUBLISHED_VERSION] == 3.0 and row[SpeculatorKeys.LOSS] == 1.25


def test_with_a_drafter_the_rows_the_live_line_and_report_png_show_the_tail(tmp_path: Path) -> None:
    from rlbus.schemas import Heartbeat
    from rlbus.schemas.metric_keys import DraftKeys, SpeculativeKeys
    from rlbus.services.up.report import write_report
    from rlbus.services.up.watch import _line

    mon = Monitor(path=tmp_path / "metrics.jsonl", eval_size=200)
    for gen, rate in (("gen-0", 0.2), ("gen-1", 0.4)):
        mon.on_heartbeat(Heartbeat(service="generator", instance=gen, seq=1, ts=1.0, version=3,
                                   metrics={SpeculativeKeys.ACCEPTANCE_RATE: rate, SpeculativeKeys.TOKENS_PER_FORWARD: 1.5,
                                            DraftKeys.VERSION_LAG: 2.0}))
    rows = [mon.on_heartbeat(Heartbeat(service="trainer", instance="trainer-0", seq=s, ts=1.0, version=s,
                                       metrics={"trainer/step": float(s), "train/step_s": 0.1})) for s in (1, 2)]
    row = rows[-1]
    assert row is not None and abs(row[SpeculativeKeys.ACCEPTANCE_RATE] - 0.3) < 1e-12  # over the generators
    assert "draft acc 0.30 tok/fwd 1.50 lag 2" in _line(row, mon)
    plain = {"step": 1, "version": 1}
    assert "draft" not in _line(plain, mon)
    assert write_report(tmp_path / "metrics.jsonl", tmp_path / "report.png") is not None
    assert (tmp_path / "report.png").stat().st_size > 0
