"""Settling a batch: publish its rollout groups, then ack its tasks, as one step a stop cannot split.

A task is acked only after its group is stored on ROLLOUTS: a crash before the ack redelivers the
task, and the group's msg id (``rollouts.<task_id>``) dedupes the re-publish.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

from rlbus.bus.protocol import Bus, BusError
from rlbus.bus.subjects import Subjects
from rlbus.observability.logging import get_logger
from rlbus.schemas import RolloutGroup
from rlbus.services.generator.core import Generator
from rlbus.services.generator.intake import Held
from rlbus.services.runtime.lifecycle import Lifecycle

log = get_logger()


class Publisher:
    """Publishes each batch's groups to ``rollouts.<pool>`` and then acks the tasks they came from."""

    def __init__(self, bus: Bus, subjects: Subjects, gen: Generator, life: Lifecycle) -> None:
        self.bus = bus
        self.subjects = subjects
        self.gen = gen
        self.life = life

    async def settle(self, held: list[Held], groups: list[RolloutGroup], *,
                     traces: list[dict[str, str]] | None = None) -> None:
        """``traces``: the trace context each group is published with (its task's trace)."""
        items = [(self.subjects.rollouts(h.task.pool), g.encode(), g.msg_id)
                 for h, g in zip(held, groups, strict=True)]
        settling = asyncio.create_task(self._publish_then_ack(items, held, traces))
        try:
            # A stop between the publish and the acks would leave groups on the bus whose tasks
            # another generator redoes: the stop waits (up to the grace period) for both.
            await asyncio.shield(settling)
        except asyncio.CancelledError:
            with contextlib.suppress(TimeoutError, BusError):  # unsettled tasks come back after ack_wait
                await asyncio.wait_for(settling, timeout=self.life.grace)
            raise
        self.gen.note_published(sum(not h.is_eval for h in held), sum(h.is_eval for h in held),
                                Counter(h.task.pool for h in held if not h.is_eval))

    async def _publish_then_ack(self, items: list[tuple[str, bytes, str]], held: list[Held],
                                traces: list[dict[str, str]] | None) -> None:
        await self.bus.publish_many(items, item_headers=traces)
        for h in held:
            await h.delivery.ack()
