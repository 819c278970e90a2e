"""One durable pull consumer on a ``Connection``: its pull inbox, and raw message -> ``Delivery``.

What a consume loop (``rlbus.bus.consume``) and a puller (``rlbus.bus.puller``) share.  A raw message is
claim-check resolved, wrapped with a ``JetStreamSettle`` and decoded by ``rlbus.bus.outcome.decoded``
(a malformed message is dead-lettered there and never handed out).  With a ``Heartbeat``, every
message is held from the moment it lands in the inbox's buffer until it is settled; once it is a
delivery, a consume loop holds it until its handler is done, a puller (``weakly``) as long as
its caller keeps the delivery.

Settling: dead letters are written *before* the ``term`` so a crash in between redelivers (and
the dead letter's msg id, ``dead.<stream>.<seq>``, dedupes the second copy) instead of losing
it; a dead letter that cannot be written (DEAD unreachable or full) leaves the message un-acked
(naked with backoff) and logged, never raised into the consume loop or the puller's caller; an
ack, nak or term the server cannot be told (away, restarting) is logged (``settle_lost``), not
raised: the message comes back after ack_wait, as any lost ack's does.  A
claim of a work-queue message is released only once the server has really removed the message
(``ack_sync``), so a lost ack never leaves a message pointing at deleted bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from rlbus.bus.claims import CLAIM_HEADER
from rlbus.bus.connection import Connection
from rlbus.bus.deadletter import dead_letter_id
from rlbus.bus.heartbeat import Heartbeat
from rlbus.bus.outage import UNANSWERED
from rlbus.bus.outcome import decoded
from rlbus.bus.protocol import BusClosed, BusError, ConsumerSpec, Delivery
from rlbus.bus.pull import PullInbox
from rlbus.bus.routing import WORK_QUEUES

ACK_SYNC_TIMEOUT_S = 5.0
# A settle the server never got: it redelivers the message after ack_wait.
SETTLE_LOST = (*UNANSWERED, nats.errors.ConnectionClosedError, ConnectionError)


class JetStreamSettle:
    """``rlbus.bus.outcome.Settle`` for one JetStream message: settles it at most once."""

    __slots__ = ("conn", "raw", "data", "stream", "work_queue", "claim", "settled")

    def __init__(self, conn: Connection, raw: Msg, data: bytes, stream: str, work_queue: bool,
                 claim: str | None) -> None:
        self.conn = conn
        self.raw = raw
        self.data = data  # the original bytes (claim resolved): what a dead letter keeps
        self.stream = stream
        self.work_queue = work_queue
        self.claim = claim
        self.settled = False

    async def ack(self, d: Delivery[Any]) -> None:
        if self.settled:
            return
        self.settled = True
        if self.claim and self.work_queue:
            # The claimed object may go only once the server has really removed the message.
            if await self._reaches_server("ack", self.raw.ack_sync(timeout=ACK_SYNC_TIMEOUT_S)):
                self.conn.release_claim(self.claim)
        else:
            await self._reaches_server("ack", self.raw.ack())

    async def nak(self, d: Delivery[Any] | None, delay: float = 0.0) -> None:
        if self.settled:
            return
        self.settled = True
        await self._reaches_server("nak", self.raw.nak(delay=delay if delay > 0 else None))

    async def _reaches_server(self, what: str, op: Awaitable[Any]) -> bool:
        """Run one settle; False where the server could not be told (away, restarting, the
        connection closed).  Why that is not raised: JetStream acks are at-least-once anyway, so
        every consumer already handles the redelivery an unsettled message gets after ack_wait
        (the trainer's ledger, the environments' dedupe); raised, it killed the service that
        settled during an outage instead (a trainer settling a checkpoint's groups)."""
        try:
            await op
        except SETTLE_LOST as exc:
            self.conn.log.warning("settle_lost", op=what, stream=self.stream, error=type(exc).__name__,
                                  todo="nothing: the server redelivers the message after ack_wait")
            return False
        return True

    async def term(self, d: Delivery[Any], reason: str, *, error: str = "terminated") -> None:
        await self.dead(d.subject, reason=reason, error=error, deliveries=d.deliveries,
                        stream_seq=d.stream_seq, headers=d.headers)

    async def dead(self, subject: str, *, reason: str, error: str, deliveries: int, stream_seq: int,
                   headers: dict[str, str]) -> None:
        if self.settled:
            return
        self.settled = True
        try:
            await self.conn.dead_letter(subject, self.data, error=error, reason=reason, deliveries=deliveries,
                                        headers=headers, msg_id=dead_letter_id(self.stream, stream_seq),
                                        stream_seq=stream_seq)
        except (BusClosed, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - DEAD unreachable or full: keep the message, see below
            await self._dead_letter_failed(subject, exc, reason=reason, deliveries=deliveries, stream_seq=stream_seq)
            return
        if await self._reaches_server("term", self.raw.term()) and self.claim and self.work_queue:
            self.conn.release_claim(self.claim)

    async def _dead_letter_failed(self, subject: str, exc: Exception, *, reason: str, deliveries: int,
                                  stream_seq: int) -> None:
        # The message is not terminated without its dead letter: naked with backoff, it comes back
        # and its dead letter is tried again (and past max_deliver, the max-deliveries path
        # retries it from the stream), so a DEAD that is down or full loses nothing and stops
        # nobody.  A nak that fails too (server away) leaves it to come back after ack_wait.
        self.settled = False
        delay = self.conn.backoff(deliveries)
        self.conn.log.error(
            "dead_letter_failed", subject=subject, stream=self.stream, seq=stream_seq, reason=reason,
            error=f"{type(exc).__name__}: {exc}"[:1000], retry_in_s=delay,
            todo="the message stays un-acked and is retried; check that the DEAD stream accepts writes "
                 "(`rlbus status`; a full DEAD: raise [run.retention] dead_max_msgs/dead_max_mib or remove old "
                 "dead letters)")
        try:
            await self.nak(None, delay)
        except Exception as nak_exc:  # noqa: BLE001 - unsettled either way: back after ack_wait
            self.conn.log.warning("nak_failed", subject=subject, seq=stream_seq, error=repr(nak_exc))

    async def in_progress(self, d: Delivery[Any] | None = None) -> None:
        if self.settled:
            return
        await self._reaches_server("in_progress", self.raw.in_progress())

    def note_error(self, d: Delivery[Any], error: str) -> None:
        self.conn.note_error(self.stream, d.stream_seq, error)


# The least time a message that arrived while no fetch ran waits for one before it is given back.
LEFTOVER_S = 2.0


class Durable:
    """A durable of one connection: declared on ``open``, read through one ``PullInbox``."""

    def __init__(self, conn: Connection, spec: ConsumerSpec, decode: Callable[[bytes], Any], *,
                 heartbeat: bool, return_leftovers: bool = False) -> None:
        self.conn = conn
        self.spec = spec
        self.decode = decode
        self.stream = conn.subjects.stream(spec.stream)
        self.work_queue = spec.stream in WORK_QUEUES
        self.heartbeat = Heartbeat(spec.ack_wait, name=spec.durable, log=conn.log) if heartbeat else None
        self.inbox: PullInbox | None = None
        # A puller's caller fetches only when it wants work; a consume loop drains its buffer itself.
        self.return_leftovers = return_leftovers
        self.leftovers_returned = 0

    async def open(self) -> PullInbox:
        if self.inbox is None:
            await self.conn.ensure_consumer(self.spec)
            hold = self.heartbeat.hold if self.heartbeat is not None else None
            leftover = self._leftover if self.return_leftovers else None
            self.inbox = await self.conn.pull_inbox(self.stream, self.spec.durable, on_message=hold,
                                                    on_leftover=leftover)
            if self.heartbeat is not None:
                self.heartbeat.start(self.conn.spawn)
        return self.inbox

    def _leftover(self, raw: Msg) -> None:
        self.conn.spawn(self._return_if_untaken(raw), name=f"leftover-{self.spec.durable}")

    async def _return_if_untaken(self, raw: Msg) -> None:
        """A message that arrived with no fetch running goes back to the server unless a fetch takes
        it within the consumer's ``ack_wait`` (the hold the server itself would grant; at least
        ``LEFTOVER_S``): held and heartbeated here without end, no other replica could ever get it —
        after a server outage one generator without grant held the last tasks of a run for good.
        A caller that fetches between steps (the trainer) takes it first; one that stops fetching
        (a generator without grant) gives it back, at the cost of one delivery."""
        await asyncio.sleep(max(LEFTOVER_S, self.spec.ack_wait))
        if self.inbox is None or not self.inbox.take_back(raw):
            return
        if self.heartbeat is not None:
            self.heartbeat.release(raw)
        self.leftovers_returned += 1
        self.conn.log.info("pull_leftover_returned", durable=self.spec.durable, subject=raw.subject,
                           returned=self.leftovers_returned)
        try:
            await raw.nak()
        except Exception as exc:  # noqa: BLE001 - unsettled either way: back after ack_wait (no heartbeat now)
            self.conn.log.warning("nak_failed", subject=raw.subject, error=repr(exc))

    async def close(self) -> None:
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self.inbox is not None:
            await self.inbox.stop()

    def release(self, d: Delivery[Any]) -> None:
        """Stop heartbeating ``d`` (settled, or given up on)."""
        if self.heartbeat is not None:
            self.heartbeat.release(d._settle)

    async def delivery(self, raw: Msg, *, weakly: bool) -> Delivery[Any] | None:
        """Resolve the claim check and decode; a bad message is dead-lettered and yields None.
        A delivery stays heartbeated from the raw message's arrival until it is settled or
        ``release``d — or, ``weakly``, until the caller lets go of it."""
        hb = self.heartbeat
        try:
            d = await self._delivery(raw)
        except BaseException:
            if hb is not None:
                hb.release(raw)
            raise
        if hb is not None:
            if d is None:
                hb.release(raw)
            else:
                hb.hand_over(raw, d._settle, owner=d if weakly else None)
        return d

    async def _delivery(self, raw: Msg) -> Delivery[Any] | None:
        md = raw.metadata
        deliveries, seq = md.num_delivered, md.sequence.stream
        headers = dict(raw.headers) if raw.headers else {}
        msg_id = headers.get("Nats-Msg-Id", "")
        data, claim = raw.data, None
        if CLAIM_HEADER in headers:  # checked here: most messages skip the resolve call entirely
            try:
                data, headers, claim = await self.conn.resolve(raw.data, headers)
            except BusError as exc:
                await self._unreadable_claim(raw, exc, deliveries=deliveries, seq=seq, headers=headers)
                return None
        settle = JetStreamSettle(self.conn, raw, data, self.stream, self.work_queue, claim)
        d: Delivery[bytes] = Delivery(msg=data, subject=raw.subject, msg_id=msg_id, deliveries=deliveries,
                                      stream_seq=seq, headers=headers, _settle=settle)
        return await decoded(d, self.decode, self.conn.log)

    async def _unreadable_claim(self, raw: Msg, exc: BusError, *, deliveries: int, seq: int,
                                headers: dict[str, str]) -> None:
        settle = JetStreamSettle(self.conn, raw, raw.data, self.stream, self.work_queue, None)
        if self.conn.claim_is_gone(exc):
            await settle.dead(raw.subject, reason="claim_missing", error=str(exc), deliveries=deliveries,
                              stream_seq=seq, headers=headers)
        else:
            msg_id = headers.get("Nats-Msg-Id", "")
            self.conn.log.warning("claim_unreadable", subject=raw.subject, msg_id=msg_id, error=str(exc))
            await settle.nak(None, self.conn.backoff(deliveries))
