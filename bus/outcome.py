"""What becomes of a delivery: the decode step and the handler outcome rules, for both buses.

``JetStreamBus`` and ``MemoryBus`` each turn a stored message into a ``Delivery`` whose ``msg``
is still the stored bytes and whose ``_settle`` implements ``Settle`` for that bus's storage;
everything after that is here, written once:

- ``decoded``: the decoder runs on the bytes.  If it raises (``SchemaError`` -> reason
  ``schema_error``, anything else -> ``decode_error``), the message is dead-lettered with the
  original bytes and the error text and terminated; the handler is never called: a malformed
  message cannot get better, and retrying it would only delay the dead letter.
- ``Outcomes.run``: the handler runs inside a ``process`` span whose parent is the producer's
  trace context, then

  - handler returns -> ``ack`` (unless the handler settled the delivery itself);
  - ``Retry(reason, delay)`` -> ``nak(delay)``; the reason is remembered as the last error (a
    handler that naks by itself passes its error: ``Delivery.nak(delay, error=...)``);
  - ``Poison(reason)`` -> dead letter with the reason, then ``term``;
  - any other exception -> logged, ``nak`` with the bus's exponential backoff, and remembered,
    so the dead letter written when ``max_deliver`` is exhausted says what went wrong;
  - cancellation (the service is stopping) -> ``nak`` at once, so another replica gets the
    message now rather than after ``ack_wait``, and the cancellation is re-raised.

A ``Settle`` settles its delivery at most once; later settlements are ignored, which is what lets
a handler ack (or term) by itself and the rules above skip what is already decided.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from rlbus.bus.deadletter import decode_failure_reason
from rlbus.bus.protocol import Delivery, Handler, Poison, Retry
from rlbus.observability.tracing import process_span

T = TypeVar("T")


class Settle(Protocol):
    """How one bus settles one delivery.  ``settled`` turns true at the first settlement."""

    settled: bool

    async def ack(self, d: Delivery[Any]) -> None: ...

    async def nak(self, d: Delivery[Any], delay: float = 0.0) -> None: ...

    async def term(self, d: Delivery[Any], reason: str, *, error: str = "terminated") -> None:
        """Dead-letter the original bytes with ``reason`` and ``error``, then terminate."""
        ...

    async def in_progress(self, d: Delivery[Any]) -> None: ...

    def note_error(self, d: Delivery[Any], error: str) -> None:
        """Remember ``error`` as the last one of ``d``'s message, for its max-deliveries dead letter."""
        ...


class Log(Protocol):
    def warning(self, event: str, **kw: Any) -> Any: ...


async def decoded(d: Delivery[bytes], decode: Callable[[bytes], T], log: Log) -> Delivery[T] | None:
    """``d`` (its ``msg`` still the stored bytes) with the decoded message, or None once the
    undecodable message has been dead-lettered and terminated."""
    try:
        msg = decode(d.msg)
    except Exception as exc:  # noqa: BLE001 - any decoder failure is permanent for these bytes
        log.warning("message_undecodable", subject=d.subject, msg_id=d.msg_id, error=str(exc))
        await d._settle.term(d, decode_failure_reason(exc), error=f"{type(exc).__name__}: {exc}")
        return None
    # The same delivery, now carrying the decoded message (no typing.cast: it would subscript
    # the generic on every message, a measurable cost on the consume path).
    d.msg = msg  # type: ignore[assignment]
    return d  # type: ignore[return-value]


class Outcomes(Generic[T]):
    """The outcome rules for one consumer's handler (see the module docstring)."""

    def __init__(self, handler: Handler[T], *, durable: str, max_deliver: int, backoff: Callable[[int], float],
                 note_error: Callable[[Delivery[Any], str], None], log: Log) -> None:
        self.handler = handler
        self.durable = durable
        self.max_deliver = max_deliver
        self.backoff = backoff
        # Where the last error of a delivery is kept until max_deliver is exhausted and the
        # dead letter is written (by the server's advisory on JetStream, by MemoryBus itself).
        self.note_error = note_error
        self.log = log

    async def run(self, d: Delivery[T]) -> None:
        s: Settle = d._settle
        with process_span(d.subject, d.headers, msg_id=d.msg_id) as span:
            try:
                await self.handler(d.msg, d)
            except Retry as r:
                self.note_error(d, f"Retry: {r.reason}")  # what the dead letter says if it never succeeds
                await s.nak(d, r.delay)
            except Poison as p:
                await s.term(d, p.reason, error="Poison")
            except asyncio.CancelledError:
                if not s.settled:
                    await s.nak(d, 0.0)
                raise
            except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the service
                span.record_exception(exc)
                error = f"{type(exc).__name__}: {exc}"
                self.note_error(d, error)
                delay = self.backoff(d.deliveries)
                self.log.warning("handler_failed", subject=d.subject, msg_id=d.msg_id, durable=self.durable,
                                 deliveries=d.deliveries, max_deliver=self.max_deliver, retry_in_s=delay,
                                 error=error)
                await s.nak(d, delay)
            else:
                if not s.settled:
                    await s.ack(d)
