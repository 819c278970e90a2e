"""Control decisions, heartbeats/metrics and dead letters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from schemas.base import Message

# Appended only (an older decoder refuses a value it does not know, so a new action is read only
# by services that handle it): "set_mix" asks the controller for a new target mix between pools.
Action = Literal["admit", "pause", "resume", "drain", "assign_pools", "concurrency", "evaluate", "stop", "set_mix"]


@dataclass(frozen=True)
class Control(Message):
    """One auditable decision.  ``params`` are cumulative/idempotent where possible (e.g. a
    generator's total admitted groups), so a lost or repeated message does no harm."""

    KIND = "control"
    seq: int
    action: Action
    target_service: str
    target_instance: str = "all"
    params: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    inputs: dict[str, Any] = field(default_factory=dict)
    issued_at: float = 0.0


@dataclass(frozen=True)
class Heartbeat(Message):
    """Periodic liveness + metrics of one service instance (path-like metric names)."""

    KIND = "heartbeat"
    service: str
    instance: str
    seq: int
    ts: float
    state: str = "running"
    version: int = -1
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id`` on METRICS (the wall-clock second keeps a restarted instance's seq 1 apart)."""
        return f"hb.{self.service}.{self.instance}.{self.seq}.{int(self.ts)}"


@dataclass(frozen=True)
class DeadLetter(Message):
    """A message that could not be processed, kept byte-for-byte with the reason."""

    KIND = "dead_letter"
    origin_subject: str
    error: str
    reason: str
    data: bytes
    deliveries: int = 1
    headers: dict[str, str] = field(default_factory=dict)
    service: str = ""
    stream_seq: int = 0
    ts: float = 0.0
