"""``JetStreamPuller``: batches of decoded deliveries that the caller settles later.

For callers that cannot settle inside a handler — the trainer acks a scored group only after the
checkpoint of the step that used it is durable, the generator holds tasks while it generates.
Every delivery the caller still holds gets ``in_progress`` heartbeats from the durable's
``Heartbeat`` until it is settled, so a long hold is not redelivered to another replica; a
delivery the caller drops without settling is only weakly held, is forgotten, and comes back
after ``ack_wait``.  Malformed messages are dead-lettered (``bus.outcome.decoded``), never
returned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from bus.connection import Connection
from bus.durable import Durable
from bus.protocol import ConsumerSpec, Delivery

T = TypeVar("T")


class JetStreamPuller(Generic[T]):
    """``bus.protocol.Puller`` on one durable of a connection."""

    def __init__(self, conn: Connection, spec: ConsumerSpec, decode: Callable[[bytes], T], *,
                 heartbeat: bool = True) -> None:
        self.conn = conn
        self.spec = spec
        self._durable = Durable(conn, spec, decode, heartbeat=heartbeat)
        self._lock = asyncio.Lock()  # one pull at a time: each waits out its own request

    async def fetch(self, max_msgs: int, timeout: float) -> list[Delivery[T]]:
        """Up to ``max_msgs`` deliveries: what is there now, else wait up to ``timeout`` for some."""
        self.conn.check_open()
        if max_msgs < 1:
            return []
        async with self._lock:
            inbox = await self._durable.open()
            raws = await inbox.fetch(max_msgs, timeout, max_bytes=self.conn.pull_max_bytes)
        out: list[Delivery[T]] = []
        for raw in raws:
            d = await self._durable.delivery(raw, weakly=True)
            if d is not None:
                out.append(d)
        return out

    async def pending(self) -> int:
        """Messages in the stream not yet delivered to this durable."""
        await self._durable.open()
        return await self.conn.consumer_pending(self._durable.stream, self.spec.durable)

    async def close(self) -> None:
        await self._durable.close()
