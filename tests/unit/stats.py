"""Statistics the sampling tests share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch


def same_distribution_p(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """p-value of a two-sample chi-square test that equal-sized samples ``a`` and ``b`` (e.g. whole
    completions) come from one distribution. Outcomes seen fewer than 10 times in both together
    are pooled into one cell, so every cell expects at least 5 per sample."""
    assert len(a) == len(b), "the statistic below assumes equal sample sizes"
    ca, cb = Counter(a), Counter(b)
    common = [c for c in ca | cb if ca[c] + cb[c] >= 10]
    rest = (len(a) - sum(ca[c] for c in common), len(b) - sum(cb[c] for c in common))
    cells = [(ca[c], cb[c]) for c in common] + [rest]
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells if x + y > 0)
    df = torch.tensor(float(len(cells) - 1))
    return float(torch.special.gammaincc(df / 2, torch.tensor(stat, dtype=torch.float64) / 2))
