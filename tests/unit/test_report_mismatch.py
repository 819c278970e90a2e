"""report.png shows the numerical train-inference gap and the policy lag as two curves, each labelled
for what it is: the total alone (k3 ~1e-2 from stale samples) read as a generator that disagrees
with the trainer, while the numerical gap is ~1e-12."""

from __future__ import annotations

from typing import Any

from rlbus.services.up.report import _mismatch_panel


class Axes:
    def __init__(self) -> None:
        self.curves: dict[str, list[float]] = {}
        self.title = ""

    def semilogy(self, x: list[float], y: list[float], *args: Any, label: str = "", **kw: Any) -> None:
        self.curves[label] = list(y)

    def set_title(self, title: str) -> None:
        self.title = title

    def legend(self, **kw: Any) -> None:
        pass


def test_the_numerical_gap_and_the_lag_are_separate_labelled_curves() -> None:
    train = [{"t": 1.0, "mismatch/k3_kl": 1e-2, "mismatch_fresh/tokens": 40.0, "mismatch_fresh/k3_kl": 1e-12,
              "mismatch_fresh/abs_diff_mean": 3e-7},
             {"t": 2.0, "mismatch/k3_kl": 2e-2, "mismatch_fresh/tokens": 0.0},  # every sample stale: no gap reading
             {"t": 3.0, "mismatch/k3_kl": 1e-2, "mismatch_fresh/tokens": 8.0, "mismatch_fresh/k3_kl": 0.0,
              "mismatch_fresh/abs_diff_mean": 0.0}]
    ax = Axes()
    _mismatch_panel(ax, train)
    gap = next(v for k, v in ax.curves.items() if k.startswith("numerical gap: k3"))
    total = next(v for k, v in ax.curves.items() if "policy lag" in k)
    assert gap == [1e-12, 1e-16] and total == [1e-2, 2e-2, 1e-2]  # an exact zero sits on the log floor
    assert "mismatch" not in ax.title
