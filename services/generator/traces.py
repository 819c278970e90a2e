"""The spans a batch adds to the traces of its tasks.

A batch samples many tasks at once, but each task keeps its own trace (opened where the task was
published): one ``generate <task_id>`` span per task, under the context its message carries, with
one child per environment call (the batched request carries every task's context, so the
environment answers each in that task's trace) and one for the sampling; the group is published
with its task's context, so the reward's scoring continues the same trace.  A few spans per task
per batch, nothing per token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
from opentelemetry.trace import INVALID_SPAN, Span

from rlbus.observability import tracing as t
from rlbus.schemas import RolloutGroup
from rlbus.services.generator.intake import Held


class BatchTraces:
    """The ``generate`` span of each task of one batch, keyed by its ``Held``."""

    def __init__(self, held: Sequence[Held], *, generator_id: str = "") -> None:
        self.spans: dict[int, Span] = {
            id(h): t.start_child(f"generate {h.task.task_id}", t.extract(h.delivery.headers), **{
                t.RUN: h.task.run, t.TASK_ID: h.task.task_id, t.POOL: h.task.pool, t.ENV: h.task.env,
                t.GROUP_SIZE: h.task.group_size, t.GENERATOR_ID: generator_id,
                t.DELIVERIES: h.delivery.deliveries, t.EVAL: h.is_eval})
            for h in held
        }

    def span(self, h: Held) -> Span:
        return self.spans.get(id(h), INVALID_SPAN)

    @contextmanager
    def calls(self, held: Sequence[Held], name: str, **attrs: object) -> Iterator[list[Span]]:
        """One ``name`` span per task in ``held`` while inside; a request sent meanwhile carries
        each task's span (in ``held`` order) for the server to continue."""
        spans = [t.start_child(name, self.span(h), **attrs) for h in held]
        try:
            with t.item_traces(spans):
                yield spans
        finally:
            for s in spans:
                s.end()

    def sampled(self, h: Held, group: RolloutGroup) -> None:
        versions = sorted({int(v) for r in group.rollouts for v in np.asarray(r.version_spans).reshape(-1, 2)[:, 1]})
        span = self.span(h)
        span.set_attribute(t.ROLLOUT_COUNT, len(group.rollouts))
        span.set_attribute(t.ROLLOUT_IDS, [r.rollout_id for r in group.rollouts])
        span.set_attribute(t.POLICY_VERSIONS, versions)
        span.set_attribute(t.PROMPT_TOKENS, group.rollouts[0].prompt_len)
        span.set_attribute(t.COMPLETION_TOKENS, sum(len(r.token_ids) - r.prompt_len for r in group.rollouts))

    def outcome(self, h: Held, outcome: str, error: str = "") -> None:
        span = self.span(h)
        span.set_attribute(t.OUTCOME, outcome)
        if error:
            span.set_attribute(t.ERROR, error[:500])

    def headers(self, held: Sequence[Held]) -> list[dict[str, str]]:
        """The trace context each task's group is published with."""
        return [t.inject(span=self.span(h)) for h in held]

    def detach(self, h: Held) -> BatchTraces:
        """``h``'s span, moved out of this batch into traces of its own (a task played on after the
        batch ends: an episode)."""
        own = BatchTraces([])
        span = self.spans.pop(id(h), None)
        if span is not None:
            own.spans[id(h)] = span
        return own

    def end(self) -> None:
        for s in self.spans.values():
            s.end()
        self.spans.clear()
