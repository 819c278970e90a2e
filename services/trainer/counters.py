"""What the trainer counts, for its heartbeat and its checkpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class Counters:
    """Cumulative totals of the run, saved in every checkpoint so that a resumed trainer continues
    them; and ``idle_s_process``, which each process counts from zero (the controller takes a
    restarted trainer's per-process counters as new, as it does ``trainer/groups_<outcome>``)."""

    groups_trained_total: float = 0.0
    groups_dropped_total: float = 0.0  # filtered, invalid or stale: told to the controller at once
    rollouts_stale_total: float = 0.0
    idle_s: float = 0.0  # waiting for a full batch
    busy_s: float = 0.0  # from a full batch to the end of its step's bookkeeping
    idle_s_process: float = dataclasses.field(default=0.0, metadata={"checkpointed": False})

    @classmethod
    def restore(cls, record: Mapping[str, float]) -> Counters:
        """From a checkpoint's ``counters`` (keys it does not know are ignored)."""
        names = {f.name for f in dataclasses.fields(cls) if f.metadata.get("checkpointed", True)}
        return cls(**{k: v for k, v in record.items() if k in names})

    def record(self) -> dict[str, float]:
        """What a checkpoint keeps."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("checkpointed", True)}

    def add_idle(self, seconds: float) -> None:
        self.idle_s += seconds
        self.idle_s_process += seconds

    @property
    def idle_fraction(self) -> float:
        total = self.idle_s + self.busy_s
        return self.idle_s / total if total else 0.0
