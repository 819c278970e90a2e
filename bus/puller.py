"""``JetStreamPuller``: batches of decoded deliveries that the caller settles later.

For callers that cannot settle inside a handler — the trainer acks a scored group only after the
checkpoint of the step that used it is durable, the generator holds tasks while it generates.
Every delivery the caller still holds gets ``in_progress`` heartbeats from the durable's
``Heartbeat`` until it is settled, so a long hold is not redelivered to another replica; a
delivery the caller drops without settling is only weakly held, is forgotten, and comes back
after ``ack_wait``.  Malformed messages are dead-lettered (``rlbus.bus.outcome.decoded``), never
returned; a message whose dead letter (or claim) cannot be handled now stays un-acked and comes
back later: ``fetch`` never raises for one message's trouble, only for a closed bus.  A message
that arrives while no fetch runs (the answer to a pull sent before a disconnect) goes back to
the server unless a fetch takes it within the consumer's ack_wait, so a caller that stops fetching
holds nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from nats.aio.msg import Msg

from rlbus.bus.connection import Connection
from rlbus.bus.durable import Durable
from rlbus.bus.protocol import BusClosed, ConsumerSpec, Delivery

T = TypeVar("T")


class JetStreamPuller(Generic[T]):
    """``rlbus.bus.protocol.Puller`` on one durable of a connection."""

    def __init__(self, conn: Connection, spec: ConsumerSpec, decode: Callable[[bytes], T], *,
                 heartbeat: bool = True) -> None:
        self.conn = conn
        self.spec = spec
        self._durable = Durable(conn, spec, decode, heartbeat=heartbeat, return_leftovers=True)
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
            try:
                d = await self._durable.delivery(raw, weakly=True)
            except (BusClosed, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - one message's trouble must not stop the caller's pulls
                await self._give_back(raw, exc)
                continue
            if d is not None:
                out.append(d)
        return out

    async def _give_back(self, raw: Msg, exc: Exception) -> None:
        """A message that could not be made a delivery stays un-acked: naked with backoff."""
        deliveries = raw.metadata.num_delivered if raw.reply else 1
        delay = self.conn.backoff(deliveries)
        self.conn.log.error("delivery_failed", subject=raw.subject, durable=self.spec.durable, retry_in_s=delay,
                            error=f"{type(exc).__name__}: {exc}"[:1000])
        try:
            await raw.nak(delay=delay)
        except Exception as nak_exc:  # noqa: BLE001 - unsettled either way: back after ack_wait
            self.conn.log.warning("nak_failed", subject=raw.subject, error=repr(nak_exc))

    async def pending(self) -> int:
        """Messages in the stream not yet delivered to this durable."""
        await self._durable.open()
        return await self.conn.consumer_pending(self._durable.stream, self.spec.durable)

    async def close(self) -> None:
        await self._durable.close()
