"""``JetStreamBus.watch``: an ordered, ephemeral consumer of a limits stream as an async iterator.

Used for weight-version events, control decisions and metrics: no durable state, no acks, the
server re-creates the consumer from the last seen sequence after a gap or a reconnect.  Claim
checks are resolved before a delivery is handed out.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from nats.js import api

from bus.protocol import BusError, Delivery
from bus.routing import stream_kind_of

if TYPE_CHECKING:
    from bus.jetstream import JetStreamBus

MiB = 1024 * 1024

_DELIVER = {
    "new": api.DeliverPolicy.NEW,
    "last_per_subject": api.DeliverPolicy.LAST_PER_SUBJECT,
    "all": api.DeliverPolicy.ALL,
}


class _NoSettle:
    """Watched (ephemeral, ack-none) deliveries need no settling."""

    async def ack(self, d: Any) -> None: ...
    async def nak(self, d: Any, delay: float = 0.0) -> None: ...
    async def term(self, d: Any, reason: str) -> None: ...
    async def in_progress(self, d: Any) -> None: ...


_NO_SETTLE = _NoSettle()
_CLOSED = object()


_NO_SETTLE = _NoSettle()
_CLOSED = object()


class Watch:
    """An ordered, ephemeral consumer as an async iterator.  Subscribes on first iteration."""

    def __init__(self, bus: JetStreamBus, subject: str, deliver: str) -> None:
        self._bus = bus
        self._subject = subject
        self._deliver = _DELIVER[deliver]
        self._sub: Any = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False

    def __aiter__(self) -> Watch:
        return self

    async def _start(self) -> None:
        stream = self._bus.subjects.stream(stream_kind_of(self._subject))
        self._sub = await self._bus._js.subscribe(
            self._subject, stream=stream, ordered_consumer=True, deliver_policy=self._deliver, cb=self._on_msg,
            pending_bytes_limit=512 * MiB,
        )

    async def _on_msg(self, raw: Msg) -> None:
        headers = dict(raw.headers) if raw.headers else {}
        try:
            data, headers, _ = await self._bus._resolve(raw.data, headers)
        except BusError as exc:
            self._bus.log.error("watch_claim_unreadable", subject=raw.subject, error=str(exc))
            return
        md = raw.metadata
        await self._queue.put(Delivery(
            msg=data, subject=raw.subject, msg_id=headers.get("Nats-Msg-Id", ""), deliveries=1,
            stream_seq=md.sequence.stream, headers=headers, _settle=_NO_SETTLE,
        ))

    async def __anext__(self) -> Delivery[bytes]:
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        if self._sub is None and not self._closed:
            await self._start()
        item = await self._queue.get()
        if item is _CLOSED:
            raise StopAsyncIteration
        return item  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bus._watches.discard(self)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection already gone
                pass
        await self._queue.put(_CLOSED)

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
