"""``JetStreamBus``: the ``rlbus.bus.protocol.Bus`` on a real NATS JetStream server.

The bus is a thin front over one ``rlbus.bus.connection.Connection`` (nats client, streams, object
store, claim check, publisher, dead letters, background tasks) and the parts built on it:

- publishing: ``rlbus.bus.publish`` (msg ids, retries with the same id until a deadline, pipelining,
  claim check for large payloads — ``rlbus.bus.claims``);
- ``consume``: ``rlbus.bus.consume.ConsumeLoop``; ``puller``: ``rlbus.bus.puller.JetStreamPuller``; both
  read a ``rlbus.bus.durable.Durable`` and follow the outcome rules of ``rlbus.bus.outcome``, with one
  ``rlbus.bus.heartbeat.Heartbeat`` per durable for what is held longer than ``ack_wait / 3``;
- dead letters, including the max-deliveries advisory path: ``rlbus.bus.connection``;
- ``watch``: ``rlbus.bus.watch.Watch``; ``last``, ``request``/``serve`` and ``streams`` are here.

Options of ``connect`` (all keyword): ``claim_threshold``, ``publish_deadline`` (s a publish may
take with the server reachable), ``publish_outage`` (s a publish waits out a disconnected server,
``rlbus.bus.publish``), ``attempt_timeout`` (s), ``error_backoff`` ((base, cap) s of a failed handler's
redelivery), ``shutdown_grace`` (s a running handler gets when its consume is cancelled),
``serve_concurrency``, ``retention`` (a ``rlbus.bus.retention.Retention``: the streams' limits, applied
in place; None keeps existing limits; its ``replicas`` the copies in a cluster), plus ``ensure``
(declare the run's streams) and ``connect_timeout`` (s to reach a server, and then to declare the
streams on one that cannot answer yet: a cluster electing its leader or joining its nodes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from rlbus.bus.connection import Connection
from rlbus.bus.consume import ConsumeLoop
from rlbus.bus.objects import JetStreamObjectStore
from rlbus.bus.outage import api_errors
from rlbus.bus.protocol import (
    BusClosed,
    BusError,
    ClaimsCollected,
    ConsumerSpec,
    ConsumerState,
    Delivery,
    Handler,
    RequestFailed,
    StreamState,
)
from rlbus.bus.puller import JetStreamPuller
from rlbus.bus.routing import stream_kind_of
from rlbus.bus.subjects import STREAM_KINDS, Subjects
from rlbus.bus.watch import Watch
from rlbus.observability.tracing import inject, process_span, send_span

T = TypeVar("T")

ERROR_HEADER = "Rlbus-Error"
ERROR_TEXT_MAX = 1000


class JetStreamBus:
    """The real bus.  Build with ``await JetStreamBus.connect(url, run, name=...)``."""

    def __init__(self, nc: Any, run: str, *, name: str, **options: Any) -> None:
        self._attach(Connection(nc, run, name=name, **options))

    @classmethod
    async def connect(cls, url: str, run: str, *, name: str, ensure: bool = True, connect_timeout: float = 10.0,
                      **options: Any) -> JetStreamBus:
        """Connect (reconnecting forever after the first success), declare the run's streams."""
        conn = await Connection.open(url, run, name=name, connect_timeout=connect_timeout, **options)
        if ensure:
            try:
                await conn.ensure_streams(deadline=connect_timeout)
            except BaseException:
                conn.begin_close()
                await conn.close()
                raise
        return cls.over(conn)

    @classmethod
    def over(cls, connection: Connection) -> JetStreamBus:
        """A bus over an open connection."""
        bus = cls.__new__(cls)
        bus._attach(connection)
        return bus

    def _attach(self, connection: Connection) -> None:
        self.connection = connection
        self._watches: set[Watch] = set()
        self._pullers: list[JetStreamPuller[Any]] = []

    # --- what services read off the bus ------------------------------------------------
    @property
    def subjects(self) -> Subjects:
        return self.connection.subjects

    @property
    def name(self) -> str:
        return self.connection.name

    @property
    def log(self) -> Any:
        return self.connection.log

    @property
    def max_payload(self) -> int:
        return self.connection.max_payload

    @property
    def claim_threshold(self) -> int:
        return self.connection.claim_threshold

    @property
    def objects(self) -> JetStreamObjectStore:
        return self.connection.objects

    def backoff(self, deliveries: int) -> float:
        return self.connection.backoff(deliveries)

    # --- publish / dead letters ----------------------------------------------------------
    async def publish(self, subject: str, data: bytes, *, msg_id: str,
                      headers: dict[str, str] | None = None) -> None:
        await self.connection.publish(subject, data, msg_id=msg_id, headers=headers)

    async def publish_many(self, items: Sequence[tuple[str, bytes, str]], *, headers: dict[str, str] | None = None,
                           item_headers: Sequence[dict[str, str]] | None = None) -> None:
        """Pipelined publishes (``publish_async``); failures retried one by one."""
        await self.connection.publish_many(items, headers=headers, item_headers=item_headers)

    async def dead_letter(self, origin_subject: str, data: bytes, *, error: str, reason: str, deliveries: int = 1,
                          headers: dict[str, str] | None = None, msg_id: str | None = None,
                          stream_seq: int = 0) -> None:
        """Record a bad message on ``rl.<run>.dead.<origin kind>``: ``reason`` says why it was
        dead-lettered (``schema_error``, ``max_deliveries``, a ``Poison``/``term`` reason) and
        ``error`` carries the detail (exception text).  Large originals travel by claim check."""
        await self.connection.dead_letter(origin_subject, data, error=error, reason=reason, deliveries=deliveries,
                                          headers=headers, msg_id=msg_id, stream_seq=stream_seq)

    # --- consume -----------------------------------------------------------------------
    def puller(self, spec: ConsumerSpec, decode: Callable[[bytes], T], *, heartbeat: bool = True) -> JetStreamPuller[T]:
        self.connection.check_open()
        p: JetStreamPuller[T] = JetStreamPuller(self.connection, spec, decode, heartbeat=heartbeat)
        self._pullers.append(p)
        return p

    async def consume(self, spec: ConsumerSpec, decode: Callable[[bytes], T], handler: Handler[T], *,
                      batch: int = 16, concurrency: int = 1) -> None:
        """Handle messages until cancelled; on cancel, running handlers get ``shutdown_grace``."""
        self.connection.check_open()
        if batch < 1 or concurrency < 1:
            raise BusError(f"batch ({batch}) and concurrency ({concurrency}) must be >= 1")
        loop = ConsumeLoop(self.connection, spec, decode, handler, batch=batch, concurrency=concurrency,
                           grace=self.connection.shutdown_grace)
        await loop.run()

    # --- request / serve ---------------------------------------------------------------
    async def request(self, subject: str, data: bytes, *, timeout: float) -> bytes:
        self.connection.check_open()
        with send_span(subject):
            try:
                msg = await self.connection.nc.request(subject, data, timeout=timeout, headers=inject({}) or None)
            except nats.errors.NoRespondersError:
                raise RequestFailed(subject, "no responders (is a service answering this subject running?)") from None
            except (TimeoutError, nats.errors.TimeoutError):
                raise RequestFailed(subject, f"no reply within {timeout}s") from None
            except nats.errors.ConnectionClosedError:
                raise BusClosed(f"bus {self.name!r} is closed") from None
        if msg.headers and ERROR_HEADER in msg.headers:
            raise RequestFailed(subject, f"the responder failed: {msg.headers[ERROR_HEADER]}")
        return msg.data

    async def serve(self, subject: str, handler: Callable[[bytes], Awaitable[bytes]], *, queue: str) -> None:
        """Subscribe in ``queue`` and return; requests are answered concurrently until close.
        A handler exception is answered with an ``Rlbus-Error`` header (the requester raises
        ``RequestFailed`` with its text) instead of leaving the requester to time out."""
        conn = self.connection
        conn.check_open()
        sem = asyncio.Semaphore(conn.serve_concurrency)

        async def answer(msg: Msg) -> None:
            async with sem:
                with process_span(msg.subject, msg.headers):
                    try:
                        out = await handler(msg.data)
                    except Exception as exc:  # noqa: BLE001 - a bad request must not kill the server
                        conn.log.warning("serve_handler_failed", subject=msg.subject, error=repr(exc))
                        if msg.reply:
                            err = f"{type(exc).__name__}: {exc}".replace("\r", " ").replace("\n", " ")
                            await conn.nc.publish(msg.reply, b"", headers={ERROR_HEADER: err[:ERROR_TEXT_MAX]})
                        return
                if msg.reply:
                    await conn.nc.publish(msg.reply, out)

        async def on_msg(msg: Msg) -> None:
            conn.spawn(answer(msg), name=f"serve-{subject}")

        await conn.nc.subscribe(subject, queue=queue, cb=on_msg)

    # --- limits streams: watch / last --------------------------------------------------
    def watch(self, subject: str, *,
              deliver: Literal["new", "last_per_subject", "all"] = "new") -> AsyncIterator[Delivery[bytes]]:
        self.connection.check_open()
        w = Watch(self.connection, subject, deliver, on_close=self._watches.discard)
        self._watches.add(w)
        return w

    async def last(self, subject: str, *, wait: bool = False) -> bytes | None:
        self.connection.check_open()
        got = await self.connection.last_msg(self.subjects.stream(stream_kind_of(subject)), subject, wait=wait)
        return None if got is None else got[0]

    # --- introspection -----------------------------------------------------------------
    async def streams(self) -> list[StreamState]:
        js = self.connection.js
        out = []
        for kind in STREAM_KINDS:
            name = self.subjects.stream(kind)
            try:
                with api_errors(f"stream info of {name}"):
                    info = await js.stream_info(name)
                    consumers = await js.consumers_info(name)
            except NotFoundError:
                continue
            out.append(StreamState(
                name=name, subjects=tuple(info.config.subjects or ()), messages=info.state.messages,
                bytes=info.state.bytes,
                consumers=tuple(
                    ConsumerState(name=c.name, pending=int(c.num_pending or 0), ack_pending=int(c.num_ack_pending or 0),
                                  redelivered=int(c.num_redelivered or 0), waiting=int(c.num_waiting or 0))
                    for c in consumers
                ),
            ))
        return out

    async def collect_claims(self, *, margin: float | None = None) -> ClaimsCollected:
        return await self.connection.collect_claims(margin=margin)

    # --- close -------------------------------------------------------------------------
    async def close(self) -> None:
        """Close watches and pullers, stop background work, drain the connection; idempotent."""
        if not self.connection.begin_close():
            return
        for w in list(self._watches):
            await w.aclose()
        for p in self._pullers:
            await p.close()
        await self.connection.close()

    async def __aenter__(self) -> JetStreamBus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
