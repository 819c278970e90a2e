"""Task intake: which tasks this replica takes from TASKS, and when.

Held-out (eval) tasks are taken first and never admitted; training tasks only within the
controller's admission grant, split over the routed pools by their shares.  A grant that opens
only a few groups at a time is pooled into fuller batches.  Nothing is taken while draining.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlbus.bus.protocol import Bus, ConsumerSpec, Delivery, Puller
from rlbus.bus.subjects import Subjects
from rlbus.schemas import Task
from rlbus.services.generator.core import Generator
from rlbus.services.generator.status import Status
from rlbus.services.runtime.lifecycle import Lifecycle

# Seconds before the server hands an un-acked task to another replica.  Held tasks are heartbeated
# (in_progress) by the bus's puller every third of it, so only a generator that died loses them,
# for about this long.
TASK_ACK_WAIT = 8.0
TASK_MAX_DELIVER = 5  # then the server's max-deliveries advisory dead-letters the task


@dataclass
class Held:
    """A task this replica took and has not settled yet."""

    delivery: Delivery[Task]
    is_eval: bool

    @property
    def task(self) -> Task:
        return self.delivery.msg


class TaskIntake:
    """Pulls tasks per pool: eval first, then training tasks within the grant by the routed shares."""

    def __init__(self, bus: Bus, subjects: Subjects, gen: Generator, status: Status, life: Lifecycle, *,
                 train_pools: list[str], eval_pools: list[str], eval_room: int, max_ack_pending: int) -> None:
        self.bus = bus
        self.subjects = subjects
        self.gen = gen
        self.status = status
        self.life = life
        # A held-out round is hundreds of single greedy samples: take it in one backend call
        # (sized like one training batch in sequences) rather than many small ones, which cost
        # a decode loop each and delay the training batch behind them.
        self.eval_room = eval_room
        self.max_ack_pending = max_ack_pending
        self.train_pullers: dict[str, Puller[Task]] = {p: self._puller(p) for p in train_pools}
        self.eval_pullers: dict[str, Puller[Task]] = {p: self._puller(p) for p in eval_pools}

    def _puller(self, pool: str) -> Puller[Task]:
        """The pool's durable consumer, shared by every replica (a work queue: each task goes to one)."""
        spec = ConsumerSpec(stream="TASKS", durable=self.subjects.durable("generator", pool),
                            filter_subjects=(self.subjects.tasks(pool),), ack_wait=TASK_ACK_WAIT,
                            max_deliver=TASK_MAX_DELIVER, max_ack_pending=self.max_ack_pending)
        return self.bus.puller(spec, Task.decode)

    def _train_puller(self, pool: str) -> Puller[Task]:
        if pool not in self.train_pullers:  # a pool routed here later
            self.train_pullers[pool] = self._puller(pool)
        return self.train_pullers[pool]

    async def take(self) -> list[Held]:
        """Eval tasks first (never admitted), then training tasks within the grant, split over the
        routed pools by their shares; room a pool cannot fill goes to the next pools in priority order."""
        if self.gen.mode == "draining":
            return []
        held: list[Held] = []
        for puller in self.eval_pullers.values():
            held.extend(Held(d, True) for d in await puller.fetch(self.eval_room, timeout=0.01))
        room = self.gen.room
        short: set[str] = set()
        for pool, n in self.gen.split_room(room):
            batch = await self._train_puller(pool).fetch(n, timeout=0.05)
            self.gen.note_taken(pool, n)  # a shortfall counts as taken: a dry pool builds no backlog of share
            held.extend(Held(d, False) for d in batch)
            room -= len(batch)
            if len(batch) < n:
                short.add(pool)
        for pool in self.gen.pools:
            if room <= 0:
                break
            if pool in short:
                continue
            batch = await self._train_puller(pool).fetch(room, timeout=0.01)
            self.gen.note_taken(pool, len(batch))
            held.extend(Held(d, False) for d in batch)
            room -= len(batch)
        return held

    async def wait_for_fuller_grant(self, min_groups: int, max_wait_s: float) -> None:
        """A batch costs a prefill and max_new_tokens forwards whatever its size, and a grant that
        opens a few groups at a time (top-ups for dropped groups) would otherwise be sampled as
        many small batches. While the room is small, wait up to ``max_wait_s`` for it to grow. Room
        stays small only when this generator is ahead of the trainer, so the wait costs nothing;
        a generator that is behind always finds a large room and never waits."""
        want = min(min_groups, self.gen.batch_cap)
        deadline = time.monotonic() + max_wait_s
        while 0 < self.gen.budget < want and not self.life.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or not await self.status.wait_for_change(left):
                return
