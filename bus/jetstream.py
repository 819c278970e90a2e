"""``JetStreamBus``: the ``bus.protocol.Bus`` on a real NATS JetStream server.

Publishing: every message carries ``Nats-Msg-Id`` (the stream's duplicate window stores a
retried publish once) and the W3C trace context of a ``send`` span.  A publish is retried with
backoff and the *same* msg id on the errors a restarting server or a stream-leader election
produce (no responders, timeouts, 503) until a deadline, then raises ``PublishTimeout``.

Claim check: a payload above ``claim_threshold`` (default: the server's ``max_payload`` less
512 KiB of headroom for headers) is written to the run's object store as ``claims/<msg_id>``
and a small reference message (header ``Rlbus-Claim``) is published instead.  Every read path
(consume, puller, watch, last, dead letters) resolves it, so callers only ever see the original
bytes.  Claims of work-queue messages are deleted once the message is acked or terminated;
claims on limits streams live as long as the run's bucket (they are what replay reads).

Dead letters: handler outcomes are in ``bus.consume``.  A message that exhausts
``max_deliver`` stays in its stream and the server only emits an advisory; this bus subscribes
(in a queue group, so one replica acts) to ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES`` for
every durable it consumes, copies the message byte-for-byte to DEAD with reason
``max_deliveries`` and the last handler error it saw, and then deletes it from a work-queue
stream — so it is neither lost nor stuck.  Limit: an advisory emitted while no bus consuming
that durable is connected is not seen (advisories are not persisted); such a message stays in
the work queue, visible in ``streams()`` as stored-but-not-pending.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

import nats
import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from bus.consume import JetStreamPuller, consume
from bus.objects import JetStreamObjectStore
from bus.protocol import (
    BusClosed,
    BusError,
    ConsumerSpec,
    ConsumerState,
    Delivery,
    DigestMismatch,
    Handler,
    ObjectNotFound,
    PayloadTooLarge,
    PublishTimeout,
    RequestFailed,
    StreamState,
)
from bus.routing import WORK_QUEUES, origin_token, stream_kind_of
from bus.streams import ensure_consumer, ensure_streams
from bus.subjects import STREAM_KINDS, Subjects
from bus.watch import Watch
from observability.logging import get_logger
from observability.tracing import TRACE_HEADER_BUDGET, inject, process_span, send_span
from schemas import DeadLetter

T = TypeVar("T")

KiB, MiB = 1024, 1024 * 1024
CLAIM_HEADER = "Rlbus-Claim"
CLAIM_SIZE_HEADER = "Rlbus-Claim-Size"
ERROR_HEADER = "Rlbus-Error"
CLAIM_HEADROOM = 512 * KiB
# User headers plus trace context; the claim threshold leaves far more room than this.
HEADER_BUDGET = 4 * KiB + TRACE_HEADER_BUDGET
PUBLISH_WINDOW_BYTES = 64 * MiB
MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"

_RETRYABLE = (
    NoStreamResponseError, ServiceUnavailableError, nats.errors.TimeoutError, asyncio.TimeoutError,
    nats.errors.OutboundBufferLimitError, nats.errors.NoRespondersError,
)

def _header_bytes(headers: dict[str, str]) -> int:
    return 12 + sum(len(k) + len(v) + 4 for k, v in headers.items())


class JetStreamBus:
    """The real bus.  Build with ``await JetStreamBus.connect(url, run, name=...)``."""

    def __init__(self, nc: Any, run: str, *, name: str, claim_threshold: int | None = None,
                 publish_deadline: float = 30.0, attempt_timeout: float = 5.0,
                 error_backoff: tuple[float, float] = (1.0, 30.0), shutdown_grace: float = 10.0,
                 serve_concurrency: int = 64) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=10.0)
        self._api_prefix = "$JS.API"
        self.subjects = Subjects(run)
        self.name = name
        self.max_payload = int(nc.max_payload)
        default_threshold = max(self.max_payload - CLAIM_HEADROOM, self.max_payload // 2)
        self.claim_threshold = min(claim_threshold or default_threshold, default_threshold)
        self.publish_deadline = publish_deadline
        self.attempt_timeout = attempt_timeout
        self.error_backoff = error_backoff
        self.shutdown_grace = shutdown_grace
        self.serve_concurrency = serve_concurrency
        # Each pull is capped by bytes: a few of the largest messages, far below max_pending.
        self.pull_max_bytes = max(4 * self.max_payload, 32 * MiB)
        self.log = get_logger(component="bus", bus=name, run=run)
        self._objects = JetStreamObjectStore(nc, self._js, self.subjects.object_bucket)
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subs: list[Any] = []
        self._watches: set[Watch] = set()
        self._pullers: list[JetStreamPuller[Any]] = []
        self._advisories: set[tuple[str, str]] = set()
        self._consumers_ok: set[tuple[str, str]] = set()
        self._last_errors: dict[tuple[str, int], str] = {}

    # --- construction ----------------------------------------------------------------
    @classmethod
    async def connect(cls, url: str, run: str, *, name: str, ensure: bool = True, connect_timeout: float = 10.0,
                      **options: Any) -> JetStreamBus:
        """Connect (reconnecting forever after the first success), declare the run's streams."""
        if not url:
            raise BusError("a NATS URL is required (e.g. nats://127.0.0.1:4222); start one with `rlbus nats`")
        log = get_logger(component="bus", bus=name, run=run)
        made: list[JetStreamBus] = []  # the callbacks stay quiet about our own close

        def closing() -> bool:
            return bool(made) and made[0]._closed

        async def on_error(exc: Exception) -> None:
            if not closing():
                log.warning("nats_error", error=repr(exc))

        async def on_disconnect() -> None:
            if not closing():
                log.warning("nats_disconnected", url=url)

        async def on_reconnect() -> None:
            log.info("nats_reconnected", url=url)

        nc = nats.NATS()
        try:
            await asyncio.wait_for(nc.connect(
                servers=[url], name=name, allow_reconnect=True, max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,  # type: ignore[arg-type]  # nats-py takes float seconds
                connect_timeout=2, ping_interval=10, max_outstanding_pings=3,
                pending_size=64 * MiB, drain_timeout=10, error_cb=on_error,
                disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
            ), timeout=connect_timeout)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - we are already reporting the real failure
                pass
            raise BusError(
                f"cannot connect to NATS at {url} within {connect_timeout:.0f}s ({exc!r}); "
                "is the server running (`rlbus nats`) and the URL right?"
            ) from None
        bus = cls(nc, run, name=name, **options)
        made.append(bus)
        if ensure:
            await ensure_streams(bus._js, bus.subjects)
        return bus

    @property
    def objects(self) -> JetStreamObjectStore:
        return self._objects

    def _check_open(self) -> None:
        if self._closed or self._nc.is_closed:
            raise BusClosed(f"bus {self.name!r} is closed")

    def _spawn(self, coro: Awaitable[Any], *, name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def backoff(self, deliveries: int) -> float:
        base, cap = self.error_backoff
        return float(min(base * 2 ** max(deliveries - 1, 0), cap))

    # --- publish -----------------------------------------------------------------------
    def _headers(self, msg_id: str, extra: dict[str, str] | None) -> dict[str, str]:
        if not msg_id:
            raise BusError("every publish needs a msg_id (it is what makes retries safe)")
        h = inject(extra)
        h["Nats-Msg-Id"] = msg_id
        if extra:
            for k, v in extra.items():
                if not isinstance(v, str) or "\r" in v or "\n" in v or "\r" in k or "\n" in k or ":" in k:
                    raise BusError(f"header {k!r} must be a str key/value without CR/LF (and no ':' in the key)")
            if _header_bytes(h) > HEADER_BUDGET:
                raise PayloadTooLarge(
                    f"headers of msg {msg_id!r} take {_header_bytes(h)} bytes, over the {HEADER_BUDGET}-byte "
                    "budget; put large metadata in the payload"
                )
        return h

    async def publish(self, subject: str, data: bytes, *, msg_id: str,
                      headers: dict[str, str] | None = None) -> None:
        self._check_open()
        with send_span(subject, msg_id=msg_id):
            hdrs = self._headers(msg_id, headers)
            if len(data) + _header_bytes(hdrs) > self.claim_threshold:
                data, hdrs = await self._claim(msg_id, data, hdrs)
            await self._publish_retry(subject, data, hdrs, time.monotonic() + self.publish_deadline)

    async def _claim(self, msg_id: str, data: bytes, hdrs: dict[str, str]) -> tuple[bytes, dict[str, str]]:
        name = f"claims/{msg_id}"
        info = await self._objects.put(name, data)
        hdrs = dict(hdrs)
        hdrs[CLAIM_HEADER] = name
        hdrs[CLAIM_SIZE_HEADER] = str(info.size)
        return b"", hdrs

    async def _publish_retry(self, subject: str, payload: bytes, hdrs: dict[str, str], deadline: float) -> None:
        delay, attempts = 0.05, 0
        last: BaseException | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PublishTimeout(
                    f"publish to {subject!r} (msg id {hdrs.get('Nats-Msg-Id')!r}) was not acknowledged within "
                    f"{self.publish_deadline:.0f}s after {attempts} attempts (last error: {last!r}); is the "
                    "server up, and does a stream of this run capture the subject?"
                )
            attempts += 1
            try:
                await self._js.publish(subject, payload, timeout=min(remaining, self.attempt_timeout), headers=hdrs)
                return
            except nats.errors.ConnectionClosedError:
                raise BusClosed(f"bus {self.name!r} is closed; cannot publish to {subject!r}") from None
            except nats.errors.MaxPayloadError:
                raise PayloadTooLarge(
                    f"message to {subject!r} ({len(payload)} bytes + headers) exceeds the server's max_payload "
                    f"{self.max_payload}"
                ) from None
            except _RETRYABLE as exc:
                last = exc
            except APIError as exc:
                if exc.code != 503:
                    raise BusError(f"publish to {subject!r} refused by JetStream: {exc}") from None
                last = exc
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 1.0)

    async def publish_many(self, items: Sequence[tuple[str, bytes, str]], *,
                           headers: dict[str, str] | None = None) -> None:
        """Pipelined publishes (``publish_async``) under one ``send`` span; failures retried one by one."""
        self._check_open()
        if not items:
            return
        deadline = time.monotonic() + self.publish_deadline
        with send_span(items[0][0], msg_id=items[0][2], **{"messaging.batch.message_count": len(items)}):
            base = self._headers("batch", headers)  # validates once; trace context of this span
            inflight: deque[tuple[asyncio.Future[Any], int]] = deque()
            window = 0
            retry: list[int] = []

            async def settle_oldest() -> None:
                nonlocal window
                fut, i = inflight.popleft()
                window -= len(items[i][1])
                if not fut.done():
                    await asyncio.wait([fut], timeout=max(min(self.attempt_timeout, deadline - time.monotonic()), 0))
                if not fut.done():
                    fut.cancel()
                    retry.append(i)
                elif fut.cancelled() or fut.exception() is not None:
                    exc = None if fut.cancelled() else fut.exception()
                    if exc is not None and not isinstance(exc, (*_RETRYABLE, APIError)):
                        raise BusError(f"publish to {items[i][0]!r} failed: {exc!r}")
                    retry.append(i)

            base_size = _header_bytes(base) - len("batch")
            for i, (subject, data, msg_id) in enumerate(items):
                hdrs = dict(base)
                hdrs["Nats-Msg-Id"] = msg_id
                if len(data) + base_size + len(msg_id) > self.claim_threshold:
                    data, hdrs = await self._claim(msg_id, data, hdrs)
                    await self._publish_retry(subject, data, hdrs, deadline)
                    continue
                try:
                    fut = await self._js.publish_async(subject, data, headers=hdrs)
                except nats.errors.ConnectionClosedError:
                    raise BusClosed(f"bus {self.name!r} is closed; cannot publish to {subject!r}") from None
                except _RETRYABLE:
                    retry.append(i)
                    continue
                inflight.append((fut, i))
                window += len(data)
                while window > PUBLISH_WINDOW_BYTES:
                    await settle_oldest()
            while inflight:
                await settle_oldest()
            for i in retry:
                subject, data, msg_id = items[i]
                hdrs = dict(base)
                hdrs["Nats-Msg-Id"] = msg_id
                await self._publish_retry(subject, data, hdrs, deadline)

    # --- claim check -------------------------------------------------------------------
    async def _resolve(self, data: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str], str | None]:
        name = headers.get(CLAIM_HEADER)
        if name is None:
            return data, headers, None
        body = await self._objects.get(name)
        headers = {k: v for k, v in headers.items() if k not in (CLAIM_HEADER, CLAIM_SIZE_HEADER)}
        return body, headers, name

    @staticmethod
    def _claim_is_gone(exc: BaseException) -> bool:
        return isinstance(exc, (ObjectNotFound, DigestMismatch))

    def _release_claim(self, name: str) -> None:
        async def release() -> None:
            try:
                await self._objects.delete(name)
            except Exception as exc:  # noqa: BLE001 - a leftover claim costs bytes, not correctness
                self.log.warning("claim_release_failed", claim=name, error=repr(exc))

        self._spawn(release(), name=f"release-{name}")

    # --- consume -----------------------------------------------------------------------
    async def _ensure_consumer(self, spec: ConsumerSpec) -> str:
        stream = self.subjects.stream(spec.stream)
        key = (stream, spec.durable)
        if key not in self._consumers_ok:
            await ensure_consumer(self._js, self.subjects, spec)
            self._consumers_ok.add(key)
        await self._watch_max_deliveries(stream, spec.durable)
        return stream

    def puller(self, spec: ConsumerSpec, decode: Callable[[bytes], T], *, heartbeat: bool = True) -> JetStreamPuller[T]:
        self._check_open()
        p: JetStreamPuller[T] = JetStreamPuller(self, spec, decode, heartbeat=heartbeat)
        self._pullers.append(p)
        return p

    async def consume(self, spec: ConsumerSpec, decode: Callable[[bytes], T], handler: Handler[T], *,
                      batch: int = 16, concurrency: int = 1) -> None:
        """Handle messages until cancelled; on cancel, running handlers get ``shutdown_grace``."""
        self._check_open()
        if batch < 1 or concurrency < 1:
            raise BusError(f"batch ({batch}) and concurrency ({concurrency}) must be >= 1")
        await consume(self, spec, decode, handler, batch=batch, concurrency=concurrency, grace=self.shutdown_grace)

    def _note_error(self, stream: str, seq: int, error: str) -> None:
        self._last_errors[(stream, seq)] = error
        if len(self._last_errors) > 10_000:  # bounded: only needed until the advisory arrives
            for k in list(self._last_errors)[:5_000]:
                del self._last_errors[k]

    async def _watch_max_deliveries(self, stream: str, consumer: str) -> None:
        if (stream, consumer) in self._advisories:
            return
        self._advisories.add((stream, consumer))
        sub = await self._nc.subscribe(
            f"{MAX_DELIVERIES_ADVISORY}.{stream}.{consumer}", queue=f"rlbus_dead_{consumer}",
            cb=self._on_max_deliveries,
        )
        self._subs.append(sub)

    async def _on_max_deliveries(self, msg: Msg) -> None:
        try:
            adv = json.loads(msg.data)
            stream, seq, deliveries = adv["stream"], int(adv["stream_seq"]), int(adv.get("deliveries", 0))
        except (ValueError, KeyError, TypeError) as exc:
            self.log.error("advisory_unreadable", subject=msg.subject, error=repr(exc))
            return
        try:
            await self._dead_letter_stored(stream, seq, deliveries)
        except Exception as exc:  # noqa: BLE001 - logged with everything needed to act by hand
            self.log.error("max_deliveries_dead_letter_failed", stream=stream, seq=seq, error=repr(exc))

    async def _dead_letter_stored(self, stream: str, seq: int, deliveries: int) -> None:
        try:
            raw = await self._js.get_msg(stream, seq)
        except NotFoundError:
            return  # already handled (another replica, or acked at the last moment)
        headers = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-") or k == "Nats-Msg-Id"}
        data = raw.data or b""
        claim = headers.get(CLAIM_HEADER)
        if claim:
            try:
                data, headers, _ = await self._resolve(data, headers)
            except BusError as exc:
                headers["Rlbus-Claim-Error"] = str(exc)[:200]
        error = self._last_errors.pop(
            (stream, seq),
            f"delivered {deliveries} times without an ack (the handler failed or outlived ack_wait each time)",
        )
        await self.dead_letter(raw.subject, data, error=error, reason="max_deliveries", deliveries=deliveries,
                               headers=headers, msg_id=f"dead.{stream}.{seq}", stream_seq=seq)
        kind = stream.rsplit("_", 1)[-1]
        if kind in WORK_QUEUES:
            try:
                await self._js.delete_msg(stream, seq)
            except NotFoundError:
                pass
            if claim:
                self._release_claim(claim)
        self.log.warning("dead_lettered", stream=stream, seq=seq, reason="max_deliveries", error=error)

    # --- dead letters ------------------------------------------------------------------
    async def dead_letter(self, origin_subject: str, data: bytes, *, error: str, reason: str, deliveries: int = 1,
                          headers: dict[str, str] | None = None, msg_id: str | None = None,
                          stream_seq: int = 0) -> None:
        """Record a bad message on ``rl.<run>.dead.<origin kind>``: ``reason`` says why it was
        dead-lettered (``schema_error``, ``max_deliveries``, a ``Poison``/``term`` reason) and
        ``error`` carries the detail (exception text).  Large originals travel by claim check."""
        data = bytes(data)
        letter = DeadLetter(
            origin_subject=origin_subject, error=error, reason=reason, data=data, deliveries=deliveries,
            headers={str(k): str(v) for k, v in (headers or {}).items()}, service=self.name,
            stream_seq=stream_seq, ts=time.time(),
        )
        if msg_id is None:
            h = hashlib.sha256(f"{origin_subject}\0{reason}\0{error}\0".encode() + data).hexdigest()[:32]
            msg_id = f"dead.{h}"
        self.log.warning("dead_letter", origin=origin_subject, reason=reason, error=error[:500], deliveries=deliveries)
        await self.publish(self.subjects.dead(origin_token(origin_subject)), letter.encode(), msg_id=msg_id)

    # --- request / serve ---------------------------------------------------------------
    async def request(self, subject: str, data: bytes, *, timeout: float) -> bytes:
        self._check_open()
        with send_span(subject):
            try:
                msg = await self._nc.request(subject, data, timeout=timeout, headers=inject({}) or None)
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
        self._check_open()
        sem = asyncio.Semaphore(self.serve_concurrency)

        async def answer(msg: Msg) -> None:
            async with sem:
                with process_span(msg.subject, msg.headers):
                    try:
                        out = await handler(msg.data)
                    except Exception as exc:  # noqa: BLE001 - a bad request must not kill the server
                        self.log.warning("serve_handler_failed", subject=msg.subject, error=repr(exc))
                        if msg.reply:
                            err = f"{type(exc).__name__}: {exc}".replace("\r", " ").replace("\n", " ")[:1000]
                            await self._nc.publish(msg.reply, b"", headers={ERROR_HEADER: err})
                        return
                if msg.reply:
                    await self._nc.publish(msg.reply, out)

        async def on_msg(msg: Msg) -> None:
            self._spawn(answer(msg), name=f"serve-{subject}")

        self._subs.append(await self._nc.subscribe(subject, queue=queue, cb=on_msg))

    # --- limits streams: watch / last --------------------------------------------------
    def watch(self, subject: str, *,
              deliver: Literal["new", "last_per_subject", "all"] = "new") -> AsyncIterator[Delivery[bytes]]:
        self._check_open()
        w = Watch(self, subject, deliver)
        self._watches.add(w)
        return w

    async def last(self, subject: str) -> bytes | None:
        self._check_open()
        stream = self.subjects.stream(stream_kind_of(subject))
        try:
            raw = await self._js.get_last_msg(stream, subject, direct=True)
        except NotFoundError:
            return None
        data, _, _ = await self._resolve(raw.data or b"", dict(raw.headers or {}))
        return data

    # --- introspection -----------------------------------------------------------------
    async def streams(self) -> list[StreamState]:
        out = []
        for kind in STREAM_KINDS:
            name = self.subjects.stream(kind)
            try:
                info = await self._js.stream_info(name)
            except NotFoundError:
                continue
            consumers = await self._js.consumers_info(name)
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

    # --- close -------------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in list(self._watches):
            await w.aclose()
        for p in self._pullers:
            await p.close()
        for t in list(self._tasks):
            if t.get_name().startswith(("release-", "serve-")):
                continue  # short, and worth finishing
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        if not self._nc.is_closed:
            try:
                await asyncio.wait_for(self._nc.drain(), timeout=10.0)
            except Exception:  # noqa: BLE001 - drain failed (server gone): close hard
                pass
            if not self._nc.is_closed:
                await self._nc.close()

    async def __aenter__(self) -> JetStreamBus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
