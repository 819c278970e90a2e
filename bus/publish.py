"""Durable publishing to JetStream: msg ids, claim check, retries with a deadline, pipelining.

Every message carries ``Nats-Msg-Id`` (the stream's duplicate window stores a retried publish
once) and the W3C trace context of a ``send`` span (``rlbus.bus.headers``).  A publish is retried
with backoff and the *same* msg id on the errors a restarting server or a stream-leader
election produce (no responders, timeouts, 503).  Two clocks bound the retries (``PublishClock``):

- ``deadline``: time with the server *reachable* that a publish may take.  Past it the server is
  up but not storing the message (no stream captures the subject, a stream at a limit, a stuck
  leader election): ``PublishTimeout`` — or ``StreamFull`` when the stream refused it for being
  at a retention limit (``rlbus.bus.retention``), naming the stream, the limit and the key to raise.
- ``outage``: time with the client *disconnected* (server down, network gone).  Nothing is sent
  meanwhile (retries would only pile up in the client's buffer); the publish waits for the
  reconnect and then goes on under its ``deadline``.  The default is long (minutes) so a server
  restart or a short outage only pauses the services.  Past it ``PublishTimeout`` is raised to the
  caller, who still holds its input un-acked (a generator its tasks, reward its rollout), so the
  input is redelivered once the server is back: nothing is lost, the service may stop.

``publish_many`` pipelines with ``publish_async`` under a byte window and retries the failures
one by one under the same two clocks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import nats.errors
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from rlbus.bus.claims import ClaimCheck
from rlbus.bus.headers import MSG_ID, check_item_headers, header_bytes, publish_headers
from rlbus.bus.protocol import BusClosed, BusError, PayloadTooLarge, PublishTimeout, StreamFull
from rlbus.observability.tracing import send_span

MiB = 1024 * 1024
PUBLISH_WINDOW_BYTES = 64 * MiB
RECONNECT_POLL_S = 0.25
STORE_FAILED = 10077  # JetStream's "store failed" error code; "maximum … exceeded" = a discard-new limit

RETRYABLE = (
    NoStreamResponseError, ServiceUnavailableError, nats.errors.TimeoutError, asyncio.TimeoutError,
    nats.errors.OutboundBufferLimitError, nats.errors.NoRespondersError,
)


def limit_refusal(exc: APIError) -> str | None:
    """The server's words when a publish was refused for a discard-new retention limit, else None."""
    text = str(exc.description or "")
    if exc.err_code == STORE_FAILED and "maximum" in text:
        return text
    return None


class PublishClock:
    """How long one publish has tried: time with the server reachable (bounded by ``deadline``)
    and time with the client disconnected (bounded by ``outage``).  See the module docstring."""

    def __init__(self, deadline: float, outage: float) -> None:
        self.start = time.monotonic()
        self.deadline = deadline
        self.outage = outage
        self.away = 0.0

    def live_remaining(self) -> float:
        return self.deadline - (time.monotonic() - self.start - self.away)


class Publisher:
    """Publishes of one connection (``js``), large payloads through ``claims``.

    ``connected()`` says whether the client is connected now; ``full_error(subject, why)`` builds
    the ``StreamFull`` of a publish refused at a retention limit."""

    def __init__(self, js: Any, claims: ClaimCheck, *, name: str, max_payload: int, claim_threshold: int,
                 deadline: float, attempt_timeout: float, outage: float, connected: Callable[[], bool],
                 full_error: Callable[[str, str], StreamFull]) -> None:
        self.js = js
        self.claims = claims
        self.name = name
        self.max_payload = max_payload
        self.claim_threshold = claim_threshold
        self.deadline = deadline
        self.attempt_timeout = attempt_timeout
        self.outage = outage
        self.connected = connected
        self.full_error = full_error

    def clock(self) -> PublishClock:
        return PublishClock(self.deadline, self.outage)

    async def publish(self, subject: str, data: bytes, *, msg_id: str, headers: dict[str, str] | None) -> None:
        with send_span(subject, msg_id=msg_id):
            hdrs = publish_headers(msg_id, headers)
            clock = self.clock()
            if len(data) + header_bytes(hdrs) > self.claim_threshold:
                await self.wait_for_server(clock, subject, hdrs)
                data, hdrs = await self.claims.put(subject, msg_id, data, hdrs)
            await self._retry(subject, data, hdrs, clock)

    async def wait_for_server(self, clock: PublishClock, subject: str, hdrs: dict[str, str]) -> None:
        """Return once connected; the wait counts against ``clock.outage``, not its deadline."""
        t0 = time.monotonic()
        while not self.connected():
            if clock.away + time.monotonic() - t0 > clock.outage:
                raise PublishTimeout(
                    f"publish to {subject!r} (msg id {hdrs.get(MSG_ID)!r}): the NATS server has been unreachable "
                    f"for {clock.outage:.0f}s (the publish outage deadline); the message was not stored and the "
                    "caller's input stays un-acked. Bring the server back (or raise [run] publish_outage_s)."
                )
            await asyncio.sleep(RECONNECT_POLL_S)
        clock.away += time.monotonic() - t0

    async def _retry(self, subject: str, payload: bytes, hdrs: dict[str, str], clock: PublishClock) -> None:
        delay, attempts = 0.05, 0
        last: BaseException | None = None
        while True:
            await self.wait_for_server(clock, subject, hdrs)
            remaining = clock.live_remaining()
            if remaining <= 0:
                raise self._gave_up(subject, hdrs, attempts, last)
            attempts += 1
            t0 = time.monotonic()
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
            except APIError as exc:  # before RETRYABLE: a full stream answers 503 too
                last = self._api_failure(subject, exc)
            except RETRYABLE as exc:
                last = exc
            if not self.connected():
                clock.away += time.monotonic() - t0  # the attempt failed because the server went away
            await asyncio.sleep(min(delay, max(clock.live_remaining(), 0)))
            delay = min(delay * 2, 1.0)

    def _api_failure(self, subject: str, exc: APIError) -> BaseException:
        """What a refused publish is: retried (503s, a full discard-new stream) or raised at once."""
        why = limit_refusal(exc)
        if why is not None:
            return self.full_error(subject, why)  # retried: the queue may drain before the deadline
        if exc.code != 503:
            raise BusError(f"publish to {subject!r} refused by JetStream: {exc}") from None
        return exc

    def _gave_up(self, subject: str, hdrs: dict[str, str], attempts: int, last: BaseException | None) -> BusError:
        if isinstance(last, StreamFull):
            return last
        return PublishTimeout(
            f"publish to {subject!r} (msg id {hdrs.get(MSG_ID)!r}) was not acknowledged within "
            f"{self.deadline:.0f}s of the server being reachable, after {attempts} attempts (last error: "
            f"{last!r}); is the server healthy, and does a stream of this run capture the subject?"
        )

    async def publish_many(self, items: Sequence[tuple[str, bytes, str]], *, headers: dict[str, str] | None,
                           item_headers: Sequence[dict[str, str]] | None = None) -> None:
        if not items:
            return
        check_item_headers(items, item_headers)
        deadline = time.monotonic() + self.deadline
        with send_span(items[0][0], msg_id=items[0][2], **{"messaging.batch.message_count": len(items)}):
            base = publish_headers("batch", headers)  # validates once; trace context of this span
            window = _Window(self, items, deadline)
            for i, (subject, data, msg_id) in enumerate(items):
                hdrs = self._item_headers(base, headers, item_headers, i, msg_id)
                if len(data) + header_bytes(hdrs) > self.claim_threshold:
                    clock = self.clock()
                    await self.wait_for_server(clock, subject, hdrs)
                    data, hdrs = await self.claims.put(subject, msg_id, data, hdrs)
                    await self._retry(subject, data, hdrs, clock)
                    continue
                if not self.connected():
                    window.retry.append(i)  # not buffered in the client: sent once the server is back
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
                await self._retry(subject, data, self._item_headers(base, headers, item_headers, i, msg_id),
                                  self.clock())

    @staticmethod
    def _item_headers(base: dict[str, str], headers: dict[str, str] | None,
                      item_headers: Sequence[dict[str, str]] | None, i: int, msg_id: str) -> dict[str, str]:
        """Item ``i``'s headers: the shared ``base`` with its msg id, or, given ``item_headers``,
        its own (checked like any publish's; its ``traceparent`` wins over the current span's)."""
        if item_headers is None:
            hdrs = dict(base)
            hdrs[MSG_ID] = msg_id
            return hdrs
        return publish_headers(msg_id, {**(headers or {}), **item_headers[i]})


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
