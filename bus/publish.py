"""Durable publishing to JetStream: msg ids, claim check, retries with a deadline, pipelining.

Every message carries ``Nats-Msg-Id`` (the stream's duplicate window stores a retried publish
once) and the W3C trace context of a ``send`` span (``bus.headers``).  A publish is retried
with backoff and the *same* msg id on the errors a restarting server or a stream-leader
election produce (no responders, timeouts, 503) until a deadline, then raises
``PublishTimeout``.  ``publish_many`` pipelines with ``publish_async`` under a byte window and
retries the failures one by one under the same deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import nats.errors
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from bus.claims import ClaimCheck
from bus.headers import MSG_ID, header_bytes, publish_headers
from bus.protocol import BusClosed, BusError, PayloadTooLarge, PublishTimeout
from observability.tracing import send_span

MiB = 1024 * 1024
PUBLISH_WINDOW_BYTES = 64 * MiB

RETRYABLE = (
    NoStreamResponseError, ServiceUnavailableError, nats.errors.TimeoutError, asyncio.TimeoutError,
    nats.errors.OutboundBufferLimitError, nats.errors.NoRespondersError,
)


class Publisher:
    """Publishes of one connection (``js``), large payloads through ``claims``."""

    def __init__(self, js: Any, claims: ClaimCheck, *, name: str, max_payload: int, claim_threshold: int,
                 deadline: float, attempt_timeout: float) -> None:
        self.js = js
        self.claims = claims
        self.name = name
        self.max_payload = max_payload
        self.claim_threshold = claim_threshold
        self.deadline = deadline
        self.attempt_timeout = attempt_timeout

    async def publish(self, subject: str, data: bytes, *, msg_id: str, headers: dict[str, str] | None) -> None:
        with send_span(subject, msg_id=msg_id):
            hdrs = publish_headers(msg_id, headers)
            if len(data) + header_bytes(hdrs) > self.claim_threshold:
                data, hdrs = await self.claims.put(msg_id, data, hdrs)
            await self._retry(subject, data, hdrs, time.monotonic() + self.deadline)

    async def _retry(self, subject: str, payload: bytes, hdrs: dict[str, str], deadline: float) -> None:
        delay, attempts = 0.05, 0
        last: BaseException | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PublishTimeout(
                    f"publish to {subject!r} (msg id {hdrs.get(MSG_ID)!r}) was not acknowledged within "
                    f"{self.deadline:.0f}s after {attempts} attempts (last error: {last!r}); is the "
                    "server up, and does a stream of this run capture the subject?"
                )
            attempts += 1
            try:
                await self.js.publish(subject, payload, timeout=min(remaining, self.attempt_timeout), headers=hdrs)
                return
            except nats.errors.ConnectionClosedError:
                raise BusClosed(f"bus {self.name!r} is closed; cannot publish to {subject!r}") from None
            except nats.errors.MaxPayloadError:
                raise PayloadTooLarge(
                    f"message to {subject!r} ({len(payload)} bytes + headers) exceeds the server's max_payload "
                    f"{self.max_payload}"
                ) from None
            except RETRYABLE as exc:
                last = exc
            except APIError as exc:
                if exc.code != 503:
                    raise BusError(f"publish to {subject!r} refused by JetStream: {exc}") from None
                last = exc
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 1.0)

    async def publish_many(self, items: Sequence[tuple[str, bytes, str]], *, headers: dict[str, str] | None) -> None:
        if not items:
            return
        deadline = time.monotonic() + self.deadline
        with send_span(items[0][0], msg_id=items[0][2], **{"messaging.batch.message_count": len(items)}):
            base = publish_headers("batch", headers)  # validates once; trace context of this span
            window = _Window(self, items, deadline)
            base_size = header_bytes(base) - len("batch")
            for i, (subject, data, msg_id) in enumerate(items):
                hdrs = dict(base)
                hdrs[MSG_ID] = msg_id
                if len(data) + base_size + len(msg_id) > self.claim_threshold:
                    data, hdrs = await self.claims.put(msg_id, data, hdrs)
                    await self._retry(subject, data, hdrs, deadline)
                    continue
                try:
                    fut = await self.js.publish_async(subject, data, headers=hdrs)
                except nats.errors.ConnectionClosedError:
                    raise BusClosed(f"bus {self.name!r} is closed; cannot publish to {subject!r}") from None
                except RETRYABLE:
                    window.retry.append(i)
                    continue
                await window.add(fut, i)
            await window.drain()
            for i in window.retry:
                subject, data, msg_id = items[i]
                hdrs = dict(base)
                hdrs[MSG_ID] = msg_id
                await self._retry(subject, data, hdrs, deadline)


class _Window:
    """The pipelined publishes of one ``publish_many`` not yet acknowledged, capped in bytes."""

    def __init__(self, publisher: Publisher, items: Sequence[tuple[str, bytes, str]], deadline: float) -> None:
        self.publisher = publisher
        self.items = items
        self.deadline = deadline
        self.inflight: deque[tuple[asyncio.Future[Any], int]] = deque()
        self.bytes = 0
        self.retry: list[int] = []  # indexes to publish again, one by one

    async def add(self, fut: asyncio.Future[Any], i: int) -> None:
        self.inflight.append((fut, i))
        self.bytes += len(self.items[i][1])
        while self.bytes > PUBLISH_WINDOW_BYTES:
            await self._settle_oldest()

    async def drain(self) -> None:
        while self.inflight:
            await self._settle_oldest()

    async def _settle_oldest(self) -> None:
        fut, i = self.inflight.popleft()
        self.bytes -= len(self.items[i][1])
        if not fut.done():
            timeout = min(self.publisher.attempt_timeout, self.deadline - time.monotonic())
            await asyncio.wait([fut], timeout=max(timeout, 0))
        if not fut.done():
            fut.cancel()
            self.retry.append(i)
        elif fut.cancelled() or fut.exception() is not None:
            exc = None if fut.cancelled() else fut.exception()
            if exc is not None and not isinstance(exc, (*RETRYABLE, APIError)):
                raise BusError(f"publish to {self.items[i][0]!r} failed: {exc!r}")
            self.retry.append(i)
