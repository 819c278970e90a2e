"""``Heartbeat``: keeps deliveries we hold from being redelivered while we still hold them.

JetStream redelivers a message that is not settled within the consumer's ``ack_wait``.  A
delivery can be held for longer than that without anything being wrong: a slow handler step, a
message fetched into a consume loop's local buffer waiting for a free worker, or a delivery a
puller handed to its caller (the trainer holds scored groups until the checkpoint that used them
is durable).  Each consumer has one ``Heartbeat`` that sends ``in_progress`` (which resets the
server's ack timer) for every item held longer than ``ack_wait / 3``, and again every
``ack_wait / 3`` after that, until the item is settled or let go.

An item is dropped when it is ``release``d, when its ``settled`` attribute turns true (a
settlement made anywhere, including by the caller), or — for an item held on behalf of an
``owner`` — when the owner has been garbage collected: a delivery the caller dropped without
settling is then redelivered after ``ack_wait``, as it should be.  A failed ``in_progress``
(the server is away) is not retried here: the next beat tries again, and at worst the message
comes back after ``ack_wait``, which the consumer handles as a redelivery.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

MIN_PERIOD_S = 0.05


class Beating(Protocol):
    """Something that can reset its message's ack timer (a settle handle, a raw message)."""

    def in_progress(self) -> Awaitable[Any]: ...


@dataclass(slots=True)
class _Held:
    item: Beating
    since: float  # when it was taken, or last beaten
    owner: weakref.ref[Any] | None


class Heartbeat:
    """``in_progress`` for every held item older than ``ack_wait / 3``; see the module docstring."""

    def __init__(self, ack_wait: float, *, name: str, log: Any) -> None:
        self.period = max(ack_wait / 3.0, MIN_PERIOD_S)
        self.name = name
        self.log = log
        self._held: dict[int, _Held] = {}
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, item: Beating, *, owner: object | None = None) -> None:
        """Keep ``item`` alive from now on; with ``owner``, only as long as ``owner`` exists."""
        ref = weakref.ref(owner) if owner is not None else None
        self._held[id(item)] = _Held(item, time.monotonic(), ref)

    def release(self, item: Beating) -> None:
        self._held.pop(id(item), None)

    def hand_over(self, old: Beating, new: Beating, *, owner: object | None = None) -> None:
        """Hold ``new`` in place of ``old`` (a raw message that became a delivery), keeping the
        time ``old`` was taken: the server's ack timer did not restart either."""
        ref = weakref.ref(owner) if owner is not None else None
        held = self._held.pop(id(old), None)
        if held is None:
            self._held[id(new)] = _Held(new, time.monotonic(), ref)
        else:  # reuse the entry: this runs once per message
            held.item, held.owner = new, ref
            self._held[id(new)] = held

    def start(self, spawn: Callable[..., asyncio.Task[Any]]) -> None:
        """Start beating (once) in a task made by ``spawn(coro, name=...)``."""
        if self._task is None or self._task.done():
            self._task = spawn(self._run(), name=f"heartbeat-{self.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._held.clear()

    async def _run(self) -> None:
        # Ticking at half the period puts every beat between period and 1.5 x period after the
        # last one: at most half of ack_wait, safely inside it.
        while True:
            await asyncio.sleep(self.period / 2)
            await self.beat(time.monotonic())

    async def beat(self, now: float) -> int:
        """One round: beat what is due, forget what is settled or dropped.  Returns the beats sent."""
        sent = 0
        for key, held in list(self._held.items()):
            gone = held.owner is not None and held.owner() is None
            if gone or getattr(held.item, "settled", False):
                if self._held.get(key) is held:
                    del self._held[key]
                continue
            if now - held.since < self.period:
                continue
            held.since = now
            try:
                await held.item.in_progress()
                sent += 1
            except Exception as exc:  # noqa: BLE001 - see the module docstring: the next beat retries
                self.log.debug("heartbeat_failed", consumer=self.name, error=repr(exc))
        return sent
