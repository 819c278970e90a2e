"""The narrow bus every service talks to, as a structural Protocol.

Services never see a NATS object: they publish bytes with a message id, pull decoded messages
with explicit outcomes, answer requests, and read the object store.  Two implementations
exist: ``rlbus.bus.jetstream.JetStreamBus`` (real server) and ``rlbus.bus.memory.MemoryBus`` (in process,
for tests; its docstring lists what it does not model, e.g. ack_wait redelivery).  One contract
suite, ``tests/integration/test_bus_contract.py``, runs against both; both apply the outcome
rules below through the same code (``rlbus.bus.outcome``).

Ack outcomes are explicit (see ``Retry`` and ``Poison``): a handler that returns normally
acks, ``Retry(delay)`` naks with a delay, ``Poison(reason)`` terminates the message and
dead-letters it with the reason.  Anything else a handler raises is treated as a retry with
backoff, bounded by the consumer's ``max_deliver``, after which the server's max-deliveries
advisory dead-letters it: nothing spins forever and nothing is dropped silently.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

StreamKind = Literal["TASKS", "ROLLOUTS", "SCORED", "WEIGHTS", "UPLOADS", "CONTROL", "METRICS", "DEAD"]


class BusError(Exception):
    """Root of every error the bus raises."""


class BusConfigError(BusError):
    """A stream or consumer already exists with a configuration that conflicts with ours."""


class PublishTimeout(BusError):
    """A publish was not acknowledged by JetStream before its deadline."""


class StreamFull(BusError):
    """A stream (or the object bucket) is at a retention limit that refuses new messages
    (``discard new``): nothing was stored.  The message names the stream, the limit and the run
    config key that raises it; the caller still holds its input, so nothing is lost."""

    def __init__(self, stream: str, why: str, *, key: str = "") -> None:
        fix = f"raise {key} in the run config, or " if key else ""
        super().__init__(
            f"stream {stream} is full ({why}); nothing was stored. {fix}let its consumers catch up "
            "(`rlbus status` shows what each one has pending) and publish again"
        )
        self.stream = stream
        self.why = why
        self.key = key


class PayloadTooLarge(BusError):
    """A payload (plus headers) would exceed the server's max_payload even with claim check."""


class Retry(Exception):
    """Handler outcome: not now; redeliver after ``delay`` seconds (nak with delay)."""

    def __init__(self, reason: str, delay: float = 1.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay = delay


class Poison(Exception):
    """Handler outcome: this message can never succeed; terminate it and dead-letter it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer.  ``max_ack_pending`` bounds un-acked work in flight."""

    stream: StreamKind
    durable: str
    filter_subjects: tuple[str, ...]
    ack_wait: float = 30.0
    max_deliver: int = 5
    max_ack_pending: int = 1000
    # Where a brand-new durable starts; existing durables keep their position.
    deliver_policy: Literal["all", "new", "last_per_subject"] = "all"


@dataclass
class Delivery(Generic[T]):
    """One decoded message plus the means to settle it.  Settle exactly once."""

    msg: T
    subject: str
    msg_id: str
    deliveries: int
    stream_seq: int
    headers: dict[str, str] = field(default_factory=dict)
    _settle: Any = None  # implementation handle; never touched by services

    async def ack(self) -> None:
        await self._settle.ack(self)

    async def nak(self, delay: float = 0.0, *, error: str = "") -> None:
        """Redeliver after ``delay`` seconds.  ``error`` says what failed this time: if the message
        then runs out of ``max_deliver``, its dead letter names the last such error instead of only
        how often it was delivered."""
        if error and not self._settle.settled:
            self._settle.note_error(self, error)
        await self._settle.nak(self, delay)

    async def term(self, reason: str) -> None:
        """Terminate and dead-letter with ``reason``."""
        await self._settle.term(self, reason)

    async def in_progress(self) -> None:
        """Heartbeat: reset the ack timer for a handler that is still working."""
        await self._settle.in_progress(self)


Decoder = Callable[[bytes], T]
Handler = Callable[[T, Delivery[T]], Awaitable[None]]


class Puller(Protocol[T_co]):
    """Batch access to a durable consumer for handlers that settle later (the trainer)."""

    async def fetch(self, max_msgs: int, timeout: float) -> list[Delivery[Any]]:
        """Up to ``max_msgs`` decoded deliveries; malformed ones are dead-lettered, not returned."""
        ...

    async def pending(self) -> int:
        """Messages in the stream not yet delivered to this consumer."""
        ...


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    sha256: str


class ObjectStore(Protocol):
    async def put(self, name: str, data: bytes | memoryview) -> ObjectInfo: ...

    async def get(self, name: str) -> bytes: ...

    async def delete(self, name: str) -> None: ...

    async def list(self) -> list[ObjectInfo]: ...


@dataclass(frozen=True)
class ClaimsCollected:
    """One pass of the claim collector (``Bus.collect_claims``)."""

    collected: int  # claims deleted: no message still held can reference them
    markers: int  # delete markers of released claims removed
    orphans: int  # sets of chunks no record names (a put or delete cut short) removed
    kept: int  # claims still reachable (or too young to judge)
    seconds: float


@dataclass(frozen=True)
class ConsumerState:
    name: str
    pending: int
    ack_pending: int
    redelivered: int
    waiting: int


@dataclass(frozen=True)
class StreamState:
    name: str
    subjects: tuple[str, ...]
    messages: int
    bytes: int
    consumers: tuple[ConsumerState, ...]


class Bus(Protocol):
    """What a service may do with the bus.  Every name comes from ``rlbus.bus.subjects``."""

    async def publish(
        self, subject: str, data: bytes, *, msg_id: str, headers: dict[str, str] | None = None
    ) -> None:
        """Durable publish with server-side dedupe on ``msg_id``; retried until a deadline."""
        ...

    async def publish_many(
        self, items: Sequence[tuple[str, bytes, str]], *, headers: dict[str, str] | None = None,
        item_headers: Sequence[dict[str, str]] | None = None,
    ) -> None:
        """Pipelined durable publish of ``(subject, data, msg_id)`` items; all acked on return.
        ``item_headers`` (one dict per item, over ``headers``) gives each item its own headers,
        e.g. the trace context of its own task (``rlbus.observability.tracing.task_traces``)."""
        ...

    async def request(self, subject: str, data: bytes, *, timeout: float) -> bytes:
        """Core request/reply (environments).  Raises ``BusError`` on timeout/no responders."""
        ...

    async def serve(
        self, subject: str, handler: Callable[[bytes], Awaitable[bytes]], *, queue: str
    ) -> None:
        """Answer requests on ``subject`` in a queue group until the bus closes."""
        ...

    def puller(self, spec: ConsumerSpec, decode: Decoder[T]) -> Puller[T]: ...

    async def consume(
        self,
        spec: ConsumerSpec,
        decode: Decoder[T],
        handler: Handler[T],
        *,
        batch: int = 16,
        concurrency: int = 1,
    ) -> None:
        """Pull, decode and handle until cancelled; outcomes as in the module docstring."""
        ...

    def watch(
        self, subject: str, *, deliver: Literal["new", "last_per_subject", "all"] = "new"
    ) -> AsyncIterator[Delivery[bytes]]:
        """Ordered, ephemeral read of a limits stream (weights, control, metrics)."""
        ...

    async def last(self, subject: str, *, wait: bool = False) -> bytes | None:
        """The newest message on ``subject`` (e.g. the latest weight version), or None.  A server
        that does not answer raises ``ServerUnavailable`` at once, or with ``wait`` is waited for
        like a publish waits (what a service must read before it can start)."""
        ...

    async def dead_letter(
        self, origin_subject: str, data: bytes, *, error: str, reason: str, deliveries: int = 1,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Record a bad message with its reason on the DEAD stream."""
        ...

    @property
    def objects(self) -> ObjectStore: ...

    async def streams(self) -> list[StreamState]: ...

    async def collect_claims(self, *, margin: float | None = None) -> ClaimsCollected:
        """Delete the claim-checked payloads no message still held can reference (``rlbus.bus.claims``).
        ``margin`` (s): how long after its claim a message may still be stored; None: this bus's
        publish deadline plus outage budget plus clock slack."""
        ...

    async def close(self) -> None:
        """Drain and close; safe to call twice."""
        ...


# --- errors added by the bus implementations (same root, structured fields) -------------------


class RequestFailed(BusError):
    """A core request got no answer (no responders, timeout) or the responder reported an error."""

    def __init__(self, subject: str, why: str) -> None:
        super().__init__(f"request on {subject!r} failed: {why}")
        self.subject = subject
        self.why = why


class ObjectNotFound(BusError):
    """No object of that name in the run's object store."""

    def __init__(self, name: str, bucket: str = "") -> None:
        where = f" in bucket {bucket!r}" if bucket else ""
        super().__init__(f"object {name!r} not found{where}; was it written (or already deleted)?")
        self.name = name
        self.bucket = bucket


class BadObjectName(BusError):
    """An object name the store cannot address (empty, too long for a request's control line, not
    text): refused before any request, since a name past the server's control-line limit would make
    it close the connection for good.  Nothing was read or written."""

    def __init__(self, name: str, why: str) -> None:
        shown = name if len(name) <= 80 else f"{name[:60]}…({len(name)} characters)"
        super().__init__(f"object name {shown!r} {why}; use a non-empty name of printable characters, at most "
                         f"1024 bytes in UTF-8 (e.g. 'weights/<model>/v<N>/model.safetensors')")
        self.name = name
        self.why = why


# A name travels base64-encoded in the metadata subject (4/3 of its bytes) and in error texts; the
# server closes the connection for good on a control line over 4 KiB (a 3,000-character name did
# that), so names are bounded well below it.
MAX_OBJECT_NAME_BYTES = 1024


def check_object_name(name: object) -> str:
    """``name`` if an object store can address it; else ``BadObjectName``.  Both stores check it
    before anything else (``rlbus.bus.objects`` before any request), so they refuse the same names."""
    if not isinstance(name, str):
        raise BadObjectName(repr(name), f"is a {type(name).__name__}, not a string")
    if not name:
        raise BadObjectName(name, "is empty")
    try:
        encoded = name.encode()
    except UnicodeEncodeError as exc:
        raise BadObjectName(name, f"is not valid text ({exc.reason} at character {exc.start})") from None
    if len(encoded) > MAX_OBJECT_NAME_BYTES:
        raise BadObjectName(name, f"is {len(encoded)} bytes in UTF-8, over the limit of {MAX_OBJECT_NAME_BYTES}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise BadObjectName(name, "holds a control character")
    return name


class DigestMismatch(BusError):
    """Object bytes read back do not hash to the digest recorded when they were written."""

    def __init__(self, name: str, expected: str, actual: str) -> None:
        super().__init__(
            f"object {name!r} is corrupt: sha256 expected {expected}, got {actual}; "
            "re-write the object (the reader refused the bytes)"
        )
        self.name = name
        self.expected = expected
        self.actual = actual


class ServerUnavailable(BusError):
    """The server did not answer a JetStream API request (down, restarting, a leader election);
    the caller may try again later."""


class BusClosed(BusError):
    """The bus was closed (or its connection was lost for good); nothing more can be sent."""
