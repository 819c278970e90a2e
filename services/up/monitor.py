"""What ``rlbus up`` watches: trainer steps, generator throughput, held-out evaluation.

Writes one JSON line per trainer step (``kind: "train"``) and per completed evaluation round
(``kind: "eval"``) to ``metrics.jsonl``.  Evaluation rounds are keyed by the version the
controller scheduled them at; the line also records the versions that actually produced the
tokens, so a reported accuracy is always tied to exact weights.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.schemas import Heartbeat, ScoredGroup
from rlbus.schemas.metric_keys import DraftKeys, SpeculativeKeys

# The speculative tail's per-call figures a train row carries (report.png plots them).
DRAFTING_KEYS = (SpeculativeKeys.ACCEPTANCE_RATE, SpeculativeKeys.TOKENS_PER_FORWARD, SpeculativeKeys.MEAN_ACCEPTED_LEN,
                 SpeculativeKeys.DRAFT_S, SpeculativeKeys.VERIFY_S)


def load_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` (empty when the run wrote none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Monitor:
    path: Path
    eval_size: int
    t0: float = field(default_factory=time.time)
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    last_step: int = 0
    version: int = 0
    tokens_per_s: float = 0.0
    generators: dict[str, Heartbeat] = field(default_factory=dict)
    speculator: Heartbeat | None = None  # the latest, with [generator.speculative] drafter = "model"
    _eval_rounds: dict[int, list[tuple[float, int, int]]] = field(default_factory=lambda: defaultdict(list))
    _tok_hist: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    _rate_by: dict[str, float] = field(default_factory=dict)

    def _write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def on_heartbeat(self, hb: Heartbeat) -> dict[str, Any] | None:
        if hb.service == "generator":
            self.generators[hb.instance] = hb
            # Tokens/s over a sliding window: generators publish in bursts (one per batch).
            tok = hb.metrics.get("generator/tokens", 0.0)
            hist = self._tok_hist.setdefault(hb.instance, [])
            hist.append((hb.ts, tok))
            while len(hist) > 2 and hb.ts - hist[1][0] > 10.0:
                hist.pop(0)
            if hb.ts > hist[0][0]:
                self._rate_by[hb.instance] = (tok - hist[0][1]) / (hb.ts - hist[0][0])
                self.tokens_per_s = sum(self._rate_by.values())
            return None
        if hb.service == "speculator":
            self.speculator = hb
            return None
        if hb.service != "trainer":
            return None
        step = int(hb.metrics.get("trainer/step", 0))
        if step <= self.last_step or "train/step_s" not in hb.metrics:
            return None
        self.last_step = step
        self.version = hb.version
        row = {"kind": "train", "t": round(time.time() - self.t0, 3), "step": step, "version": hb.version,
               "generator/tokens_per_s": round(self.tokens_per_s, 1), **hb.metrics, **self.drafting()}
        self.steps.append(row)
        self._write(row)
        return row

    def drafting(self) -> dict[str, float]:
        """The draft model's state at this step (drafter "model"): the speculator's metrics and the
        largest draft lag among the generators (the one drafting with the stalest draft)."""
        out = dict(self.speculator.metrics) if self.speculator is not None else {}
        lags = [g.metrics[DraftKeys.VERSION_LAG] for g in self.generators.values()
                if DraftKeys.VERSION_LAG in g.metrics]
        if lags:
            out[DraftKeys.VERSION_LAG] = max(lags)
        # Any drafter: what the generators' latest tails did, averaged over the generators that drafted.
        for key in DRAFTING_KEYS:
            values = [g.metrics[key] for g in self.generators.values() if key in g.metrics]
            if values:
                out[key] = sum(values) / len(values)
        return out

    def on_eval(self, group: ScoredGroup) -> dict[str, Any] | None:
        round_version = int(group.task.metadata.get("eval_version", -1))
        s = group.scored[0]
        self._eval_rounds[round_version].append((s.reward, s.rollout.newest_version, s.rollout.turns))
        results = self._eval_rounds[round_version]
        if len(results) < self.eval_size:
            return None
        del self._eval_rounds[round_version]
        versions = sorted({v for _, v, _ in results})
        row = {"kind": "eval", "t": round(time.time() - self.t0, 3), "eval_round": round_version,
               "versions": versions, "pinned": versions == [round_version], "heldout/accuracy": sum(r for r, _, _ in results) / len(results), "n": len(results),
               "heldout/turns_mean": sum(t for _, _, t in results) / len(results), "trainer_step": self.last_step}
        self.evals.append(row)
        self._write(row)
        return row

    @property
    def accuracy(self) -> float | None:
        return self.sustained_accuracy(1)

    def sustained_accuracy(self, rounds: int) -> float | None:
        """Mean held-out accuracy of the latest `rounds` rounds; None until there are that many."""
        if len(self.evals) < rounds:
            return None
        return sum(r["heldout/accuracy"] for r in self.evals[-rounds:]) / rounds

    def collapsed(self) -> bool:
        recent = [r.get("batch/reward_mean", 1.0) for r in self.steps[-5:]]
        return len(recent) == 5 and max(recent) == 0.0
