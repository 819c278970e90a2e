"""``JetStreamBus.watch``: an ordered, ephemeral consumer of a limits stream as an async iterator.

Used for weight-version events, control decisions and metrics: no durable state, no acks, the
server re-creates the consumer from the last seen sequence after a gap or a reconnect.  Claim
checks are resolved before a delivery is handed out.  The consumer is created when iteration
starts (``watch()`` itself is synchronous), so ``deliver="new"`` means new from the first
``__anext__`` and ``"last_per_subject"`` the last per subject as of then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from rlbus.bus.connection import Connection
from rlbus.bus.protocol import BusError, Delivery
from rlbus.bus.routing import stream_kind_of


class _NoSettle:
    """Watched (ephemeral, ack-none) deliveries need no settling."""

    settled = True

    async def ack(self, d: Any) -> None: ...
    async def nak(self, d: Any, delay: float = 0.0) -> None: ...
    async def term(self, d: Any, reason: str, *, error: str = "terminated") -> None: ...
    async def in_progress(self, d: Any) -> None: ...
    def note_error(self, d: Any, error: str) -> None: ...


_NO_SETTLE = _NoSettle()
_CLOSED = object()


class Watch:
    """An ordered, ephemeral consumer as an async iterator.  Subscribes on first iteration."""

    def __init__(self, conn: Connection, subject: str, deliver: str, *,
                 on_close: Callable[[Watch], None] | None = None) -> None:
        if deliver not in ("new", "last_per_subject", "all"):
            raise BusError(f"watch deliver={deliver!r}: use 'new', 'last_per_subject' or 'all'")
        self._conn = conn
        self._subject = subject
        self._stream = conn.subjects.stream(stream_kind_of(subject))
        self._deliver = deliver
        self._on_close = on_close
        self._sub: Any = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False

    def __aiter__(self) -> Watch:
        return self

    async def _start(self) -> None:
        self._sub = await self._conn.subscribe_ordered(self._subject, stream=self._stream, deliver=self._deliver,
                                                       cb=self._on_msg)

    async def _on_msg(self, raw: Any) -> None:
        headers = dict(raw.headers) if raw.headers else {}
        try:
            data, headers, _ = await self._conn.resolve(raw.data, headers)
        except BusError as exc:
            self._conn.log.error("watch_claim_unreadable", subject=raw.subject, error=str(exc))
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
        if self._on_close is not None:
            self._on_close(self)
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
