"""``MaxDeliveries``: the server's max-deliveries advisories, kept in a stream so none is missed.

A message that exhausts its consumer's ``max_deliver`` stays in its stream; the server only emits
``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`` — a core NATS message that is
gone if nobody is subscribed at that moment (the consuming service crashed, or was stopped, while
holding the message's last delivery).  So each run has an ``ADVISORIES`` work-queue stream that
captures these advisories for the run's streams (``bus.streams.advisory_declaration``), and every
connection that consumes anything also pulls from its one shared durable (``rlbus_max_deliveries``):
an advisory emitted while no service was up waits there until one connects.

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
from nats.js import api
from nats.js.errors import APIError

from bus.protocol import BusClosed

if TYPE_CHECKING:
    from bus.connection import Connection

ADVISORY_DURABLE = "rlbus_max_deliveries"
FETCH_WAIT_S = 5.0
RETRY_S = (1.0, 30.0)  # backoff (base, cap) of a failed dead letter or a failed pull


class MaxDeliveries:
    """Follows the run's ADVISORIES stream on one connection (started once, on the first consumer)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.stream = conn.subjects.advisory_stream
        self.failures = 0  # consecutive failed rounds, for the backoff
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = self.conn.spawn(self.run(), name=f"advisories-{self.conn.name}")

    async def run(self) -> None:
        inbox = None
        while not self.conn.closed:
            try:
                if inbox is None:
                    await self._declare()
                    inbox = await self.conn.pull_inbox(self.stream, ADVISORY_DURABLE)
                for msg in await inbox.fetch(16, FETCH_WAIT_S):
                    await self.handle(msg)
                self.failures = 0
            except (asyncio.CancelledError, BusClosed):
                raise
            except Exception as exc:  # noqa: BLE001 - server away or stream missing: try again later
                if self.conn.closed:
                    return
                self.failures += 1
                self.conn.log.warning("advisories_unavailable", stream=self.stream, error=repr(exc),
                                      retry_in_s=self._delay())
                await asyncio.sleep(self._delay())

    def _delay(self) -> float:
        base, cap = RETRY_S
        return float(min(base * 2 ** max(self.failures - 1, 0), cap))

    async def _declare(self) -> None:
        cfg = api.ConsumerConfig(
            durable_name=ADVISORY_DURABLE, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=60.0,
            max_deliver=-1, deliver_policy=api.DeliverPolicy.ALL, max_ack_pending=1000,
        )
        try:
            await self.conn.js.add_consumer(self.stream, cfg)
        except APIError as exc:
            if exc.err_code != 10148:  # already exists (another connection made it): fine
                raise

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
