"""Intervals of one kind of generator activity, logged as merged spans for `bench/pipeline_bench.py`,
which lays the trainer's idle intervals over them (what was the generator doing while the trainer
waited?).  Per-event lines would be one every few milliseconds; merged spans are about one per
``MAX_S`` while the activity goes on."""

from __future__ import annotations

from rlbus.observability.logging import get_logger

log = get_logger()


class LoggedSpans:
    """Intervals of one activity merged into spans, each logged as ``event`` with ``started`` (epoch
    seconds) and ``span_s``.  Intervals less than ``GAP_S`` apart merge; a span is logged when a gap
    ends it or once it is ``MAX_S`` long."""

    GAP_S = 0.05
    MAX_S = 2.0

    def __init__(self, event: str) -> None:
        self.event = event
        self.started: float | None = None
        self.ended = 0.0

    def ran(self, started: float, ended: float) -> None:
        if self.started is not None and (started - self.ended > self.GAP_S or self.ended - self.started >= self.MAX_S):
            self.flush()
        if self.started is None:
            self.started = started
        self.ended = ended

    def flush(self) -> None:
        if self.started is not None:
            log.info(self.event, started=round(self.started, 4), span_s=round(self.ended - self.started, 4))
            self.started = None
