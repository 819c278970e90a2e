"""``MaxDeliveries``: the server's max-deliveries advisories, kept in a stream so none is missed.

A message that exhausts its consumer's ``max_deliver`` stays in its stream; the server only emits
``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`` — a core NATS message that is
gone if nobody is subscribed at that moment (the consuming service crashed, or was stopped, while
holding the message's last delivery).  So each run has an ``ADVISORIES`` work-queue stream that
captures these advisories for the run's streams (``rlbus.bus.streams.advisory_declaration``), and a
connection that consumes a durable also pulls from that durable's own advisory durable
(``Subjects.advisory_durable``, filtered on its one advisory subject): an advisory emitted while
no service was up waits there until one connects.

One advisory durable per consumed durable, not one for the run: with least-privilege users
(``rlbus auth init``) a service may read only the streams it consumes, so a shared follower handed
a generator an advisory about a SCORED message it was refused to read, and it could only nak it
back, over and over, until the trainer's connection happened to pull it.  Now each advisory goes
to a connection that holds the durable, and may read the message (its grants say so).  A run made
before this had one unfiltered shared durable; it is removed at the first declaration it blocks
(``rlbus.bus.streams.ensure_advisory_consumer``) and the advisories it held are read by the new ones.

For each advisory the connection copies the stored message byte for byte to DEAD with reason
``max_deliveries`` (``Connection.dead_letter_stored``) and acks the advisory only then; if the
dead letter cannot be written (DEAD down or full) the advisory is naked with backoff and tried
again, so the message is neither lost nor stuck.  An unreadable advisory is logged and dropped
(it names no message).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg

from rlbus.bus.protocol import BusClosed
from rlbus.bus.streams import ensure_advisory_consumer

if TYPE_CHECKING:
    from rlbus.bus.connection import Connection

FETCH_WAIT_S = 5.0
RETRY_S = (1.0, 30.0)  # backoff (base, cap) of a failed dead letter or a failed pull


class MaxDeliveries:
    """Follows the advisories of one durable (``durable`` of stream ``kind``) on one connection;
    started when the connection declares that durable."""

    def __init__(self, conn: Connection, kind: str, durable: str) -> None:
        self.conn = conn
        self.kind = kind
        self.durable = durable
        self.stream = conn.subjects.advisory_stream
        self.name = conn.subjects.advisory_durable(kind, durable)
        self.failures = 0  # consecutive failed rounds, for the backoff
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = self.conn.spawn(self.run(), name=f"advisories-{self.conn.name}-{self.name}")

    async def run(self) -> None:
        inbox = None
        while not self.conn.closed:
            try:
                if inbox is None:
                    await self._declare()
                    inbox = await self.conn.pull_inbox(self.stream, self.name)
                for msg in await inbox.fetch(16, FETCH_WAIT_S):
                    await self.handle(msg)
                self.failures = 0
            except (asyncio.CancelledError, BusClosed):
                raise
            except Exception as exc:  # noqa: BLE001 - server away or stream missing: try again later
                if self.conn.closed:
                    return
                self.failures += 1
                self.conn.log.warning("advisories_unavailable", stream=self.stream, durable=self.name,
                                      error=repr(exc), retry_in_s=self._delay())
                await asyncio.sleep(self._delay())

    def _delay(self) -> float:
        base, cap = RETRY_S
        return float(min(base * 2 ** max(self.failures - 1, 0), cap))

    async def _declare(self) -> None:
        replicas = self.conn.retention.replicas if self.conn.retention is not None else None
        await ensure_advisory_consumer(self.conn.js, self.conn.subjects, self.kind, self.durable,
                                       replicas=replicas, log=self.conn.log)

    async def handle(self, msg: Msg) -> None:
        try:
            adv: dict[str, Any] = json.loads(msg.data)
            stream, seq, deliveries = adv["stream"], int(adv["stream_seq"]), int(adv.get("deliveries", 0))
        except (ValueError, KeyError, TypeError) as exc:
            self.conn.log.error("advisory_unreadable", subject=msg.subject, error=repr(exc))
            await msg.ack()
            return
        try:
            await self.conn.dead_letter_stored(stream, seq, deliveries)
        except (asyncio.CancelledError, BusClosed):
            raise
        except Exception as exc:  # noqa: BLE001 - kept: the advisory comes back and is tried again
            delay = self.conn.backoff(msg.metadata.num_delivered)
            self.conn.log.error(
                "max_deliveries_dead_letter_failed", stream=stream, seq=seq, error=repr(exc), retry_in_s=delay,
                todo="the message stays in its stream and is retried; check that DEAD accepts writes")
            await msg.nak(delay=delay)
            return
        await msg.ack()
