"""``MemoryBus``: the ``Bus`` Protocol in one process, for handler and service tests.

It keeps the promises that ``tests/integration/test_bus_contract.py`` checks against both this
bus and a real JetStream server.  What it models:

- publishing: the same header checks as the real bus (``rlbus.bus.headers``: msg id required, no
  CR/LF, a header byte budget) and trace context in the headers; dedupe by msg id (forever, not
  within a time window); ``publish_many`` is a loop of ``publish``;
- streams: work queues (TASKS, ROLLOUTS: a message leaves when acked, terminated or dead-lettered)
  and limits streams (kept; each durable keeps its own position, ``deliver_policy`` included);
  durables with overlapping filters on a work-queue stream are refused (``BusConfigError``),
  as is a changed filter of an existing durable, while a changed ``ack_wait``/``max_deliver``/
  ``max_ack_pending`` updates it in place (as ``rlbus.bus.streams.ensure_consumer`` does);
- consuming, with the real bus's decode step and outcome rules (``rlbus.bus.outcome``): return ->
  ack; ``Retry`` -> redelivered after its delay with ``deliveries`` + 1; ``Poison`` -> dead
  letter with the reason and the original bytes; a decode error -> dead letter with the
  decoder's error, handler never called; any other exception -> redelivered after
  ``error_backoff`` (default ``(0, 0)``, so tests do not wait) until ``max_deliver``, then dead
  letter with reason ``max_deliveries`` and the last error; ``concurrency`` handlers at a time;
  several consume loops or pullers of one durable share its messages (each handled once);
  cancelling ``consume`` gives running handlers ``shutdown_grace`` (default 10 s, as the real
  bus) to finish, then cancels them (-> nak); closing the bus under a ``consume`` makes it raise
  ``BusClosed``;
- pullers: ``fetch`` returns what is there now or waits up to ``timeout``; a fetched delivery
  is in flight (not handed out again) until settled; ``pending()`` counts messages never yet
  delivered, as JetStream's ``num_pending`` does;
- ``request``/``serve`` (no responders, a responder's exception and a timeout all raise
  ``RequestFailed``), ``watch`` (``new``/``last_per_subject``/``all``, from the first
  ``__anext__``, as the real ordered consumer is created then) and ``last``;
- an object store that verifies sha256 (``objects.corrupt`` breaks an object for a test);
- ``streams()`` with per-durable ``pending``, ``ack_pending`` (delivered, not yet settled, naked
  ones waiting for redelivery included) and ``redelivered``.

What it does not model: ``ack_wait`` (an unsettled delivery stays in flight until it is
settled: no timed redelivery, so heartbeats are accepted and ignored), ``max_ack_pending``,
``max_payload`` and claim checks (any size is stored as is), server restarts and reconnects
(and so publishes waiting out an outage), retention limits (``rlbus.bus.retention``: message and byte
caps with ``StreamFull`` at a discard-new limit, max age, last N per subject), a dead letter that
cannot be written (DEAD here never refuses), the duplicate window's expiry, a
request timeout that leaves the responder running (here the responder is cancelled), and
ordering across subjects under concurrency.  Those are tested against a real server only
(``tests/integration/test_bus_*.py``).  Test helpers: ``dead_letters`` (decoded ``DeadLetter``
messages, in order) and ``messages(kind)`` (what a stream holds).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from rlbus.bus.deadletter import build_dead_letter, dead_letter_id, never_acked
from rlbus.bus.headers import check_item_headers, publish_headers
from rlbus.bus.outcome import Outcomes, decoded
from rlbus.bus.protocol import (
    BusClosed,
    BusConfigError,
    BusError,
    ClaimsCollected,
    ConsumerSpec,
    ConsumerState,
    Delivery,
    DigestMismatch,
    Handler,
    ObjectInfo,
    ObjectNotFound,
    RequestFailed,
    StreamState,
    check_object_name,
)
from rlbus.bus.routing import WORK_QUEUES, stream_kind_of, subject_matches
from rlbus.bus.subjects import STREAM_KINDS, Subjects
from rlbus.observability.logging import get_logger
from rlbus.observability.tracing import send_span

T = TypeVar("T")

IDLE_WAIT_S = 3600.0  # nothing due: wait for a publish or a settlement, which wake the loops


@dataclass
class _Stored:
    seq: int
    subject: str
    data: bytes
    msg_id: str
    headers: dict[str, str]


@dataclass
class _Durable:
    spec: ConsumerSpec
    stream: str  # the stream's name on a real server, for dead-letter ids
    start_seq: int  # first sequence this durable may see
    done: set[int] = field(default_factory=set)  # acked/termed (limits streams)
    inflight: set[int] = field(default_factory=set)
    deliveries: dict[int, int] = field(default_factory=dict)
    not_before: dict[int, float] = field(default_factory=dict)
    last_error: dict[int, str] = field(default_factory=dict)
    parked: set[int] = field(default_factory=set)  # reached max_deliver (dead-lettered)

    def note_error(self, d: Delivery[Any], error: str) -> None:
        self.last_error[d.stream_seq] = error


class _MemSettle:
    """``rlbus.bus.outcome.Settle`` for one in-memory delivery: settles it at most once."""

    def __init__(self, bus: MemoryBus, durable: _Durable, stored: _Stored) -> None:
        self.bus, self.durable, self.stored = bus, durable, stored
        self.settled = False

    def _finish(self) -> bool:
        if self.settled:
            return False
        self.settled = True
        self.durable.inflight.discard(self.stored.seq)
        return True

    async def ack(self, d: Delivery[Any]) -> None:
        if self._finish():
            self.bus._remove(self.durable, self.stored.seq)

    async def nak(self, d: Delivery[Any], delay: float = 0.0) -> None:
        if self._finish():
            await self.bus._redeliver(self.durable, self.stored, delay)

    async def term(self, d: Delivery[Any], reason: str, *, error: str = "terminated") -> None:
        if self._finish():
            await self.bus._dead(self.durable, self.stored, reason=reason, error=error)

    async def in_progress(self, d: Delivery[Any] | None = None) -> None:
        return None  # no ack_wait here: nothing to reset

    def note_error(self, d: Delivery[Any], error: str) -> None:
        self.durable.note_error(d, error)


class _MemPuller:
    def __init__(self, bus: MemoryBus, spec: ConsumerSpec, decode: Callable[[bytes], Any]) -> None:
        self.bus, self.spec, self.decode = bus, spec, decode

    async def fetch(self, max_msgs: int, timeout: float) -> list[Delivery[Any]]:
        self.bus._check_open()
        if max_msgs < 1:
            return []
        durable = self.bus._durable(self.spec)
        deadline = time.monotonic() + timeout
        while True:
            out: list[Delivery[Any]] = []
            while len(out) < max_msgs:
                stored = self.bus._next(durable)
                if stored is None:
                    break
                d = await self.bus._delivery(durable, stored, self.decode)
                if d is not None:
                    out.append(d)
            remaining = deadline - time.monotonic()
            if out or remaining <= 0 or self.bus._closed:
                return out
            await self.bus._wait(min(remaining, self.bus._next_due(durable)))

    async def pending(self) -> int:
        return self.bus._pending(self.bus._durable(self.spec))


class _NoopSettle:
    """Watched deliveries need no settling."""

    settled = True

    async def ack(self, d: Any) -> None: ...
    async def nak(self, d: Any, delay: float = 0.0) -> None: ...
    async def term(self, d: Any, reason: str, *, error: str = "terminated") -> None: ...
    async def in_progress(self, d: Any) -> None: ...
    def note_error(self, d: Any, error: str) -> None: ...


class _MemWatch:
    """A watch: starts at its first ``__anext__``, like the real bus's ordered consumer."""

    def __init__(self, bus: MemoryBus, subject: str, deliver: str) -> None:
        if deliver not in ("new", "last_per_subject", "all"):
            raise BusError(f"watch deliver={deliver!r}: use 'new', 'last_per_subject' or 'all'")
        self.bus, self.subject, self.deliver = bus, subject, deliver
        self.kind = stream_kind_of(subject)
        self.queue: asyncio.Queue[_Stored | None] = asyncio.Queue()
        self.started = False
        self.closed = False

    def _start(self) -> None:
        self.started = True
        existing = [s for s in self.bus._streams[self.kind] if subject_matches(self.subject, s.subject)]
        if self.deliver == "all":
            initial = existing
        elif self.deliver == "last_per_subject":
            initial = list({s.subject: s for s in existing}.values())
        else:
            initial = []
        for s in sorted(initial, key=lambda s: s.seq):
            self.queue.put_nowait(s)
        self.bus._watches.append(self)

    def offer(self, s: _Stored) -> None:
        if subject_matches(self.subject, s.subject):
            self.queue.put_nowait(s)

    def __aiter__(self) -> _MemWatch:
        return self

    async def __anext__(self) -> Delivery[bytes]:
        if self.closed and self.queue.empty():
            raise StopAsyncIteration
        if not self.started and not self.closed:
            self._start()
        s = await self.queue.get()
        if s is None:
            raise StopAsyncIteration
        return Delivery(msg=s.data, subject=s.subject, msg_id=s.msg_id, deliveries=1, stream_seq=s.seq,
                        headers=dict(s.headers), _settle=_NoopSettle())

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self in self.bus._watches:
            self.bus._watches.remove(self)
        self.queue.put_nowait(None)

    async def __aenter__(self) -> _MemWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class MemoryObjectStore:
    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes, str]] = {}

    async def put(self, name: str, data: bytes | memoryview) -> ObjectInfo:
        check_object_name(name)  # the names the real store refuses, refused here too
        b = bytes(data)
        digest = hashlib.sha256(b).hexdigest()
        self._objects[name] = (b, digest)
        return ObjectInfo(name=name, size=len(b), sha256=digest)

    async def get(self, name: str) -> bytes:
        check_object_name(name)
        if name not in self._objects:
            raise ObjectNotFound(name)
        b, expected = self._objects[name]
        actual = hashlib.sha256(b).hexdigest()
        if actual != expected:
            raise DigestMismatch(name, expected, actual)
        return b

    async def delete(self, name: str) -> None:
        check_object_name(name)
        self._objects.pop(name, None)

    async def list(self) -> list[ObjectInfo]:
        return [ObjectInfo(name=n, size=len(b), sha256=d) for n, (b, d) in sorted(self._objects.items())]

    def corrupt(self, name: str, data: bytes) -> None:
        """Test hook: replace the bytes but keep the recorded digest."""
        self._objects[name] = (data, self._objects[name][1])


class MemoryBus:
    """In-process ``Bus`` for tests; see the module docstring for what it models and what not."""

    def __init__(self, run: str = "test", *, name: str = "memory", error_backoff: tuple[float, float] = (0.0, 0.0),
                 shutdown_grace: float = 10.0) -> None:
        self.subjects = Subjects(run)
        self.name = name
        self.error_backoff = error_backoff
        self.shutdown_grace = shutdown_grace
        self.log = get_logger(component="bus", bus=name, run=run)
        self._seq = itertools.count(1)
        self._streams: dict[str, list[_Stored]] = {k: [] for k in STREAM_KINDS}
        self._ids: dict[str, set[str]] = {k: set() for k in STREAM_KINDS}
        self._durables: dict[tuple[str, str], _Durable] = {}
        self._changed = asyncio.Event()
        self._servers: list[tuple[str, Callable[[bytes], Awaitable[bytes]]]] = []
        self._watches: list[_MemWatch] = []
        self._objects = MemoryObjectStore()
        self._closed = False
        self.dead_letters: list[Any] = []  # decoded DeadLetter messages, for assertions

    # --- publish ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed(f"bus {self.name!r} is closed")

    async def publish(self, subject: str, data: bytes, *, msg_id: str, headers: dict[str, str] | None = None) -> None:
        self._check_open()
        with send_span(subject, msg_id=msg_id):
            h = publish_headers(msg_id, headers)
            kind = stream_kind_of(subject)
            if msg_id in self._ids[kind]:
                return
            self._ids[kind].add(msg_id)
            s = _Stored(next(self._seq), subject, bytes(data), msg_id, h)
            self._streams[kind].append(s)
            for w in list(self._watches):
                w.offer(s)
            self._notify()

    async def publish_many(self, items: Sequence[tuple[str, bytes, str]], *, headers: dict[str, str] | None = None,
                           item_headers: Sequence[dict[str, str]] | None = None) -> None:
        check_item_headers(items, item_headers)
        for i, (subject, data, msg_id) in enumerate(items):
            h = headers if item_headers is None else {**(headers or {}), **item_headers[i]}
            await self.publish(subject, data, msg_id=msg_id, headers=h)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, timeout: float) -> None:
        ev = self._changed
        try:
            async with asyncio.timeout(max(timeout, 0.0)):  # not wait_for: it can swallow a cancel on 3.11
                await ev.wait()
        except TimeoutError:
            pass

    # --- durables --------------------------------------------------------------------
    def _durable(self, spec: ConsumerSpec) -> _Durable:
        key = (spec.stream, spec.durable)
        d = self._durables.get(key)
        if d is None:
            if not spec.filter_subjects:
                raise BusConfigError(f"consumer {spec.durable!r} needs at least one filter subject")
            if spec.stream in WORK_QUEUES:
                self._refuse_overlap(spec)
            start = 0 if spec.deliver_policy != "new" else next(self._seq)
            d = _Durable(spec, self.subjects.stream(spec.stream), start)
            if spec.deliver_policy == "last_per_subject":
                last = {s.subject: s.seq for s in self._streams[spec.stream] if self._matches(spec, s)}
                d.done.update(s.seq for s in self._streams[spec.stream]
                              if self._matches(spec, s) and s.seq != last[s.subject])
            self._durables[key] = d
        elif d.spec != spec:
            if sorted(d.spec.filter_subjects) != sorted(spec.filter_subjects):
                raise BusConfigError(
                    f"durable {spec.durable!r} on stream {spec.stream} exists with a filter that cannot change in "
                    f"place (filter_subjects: declared {sorted(spec.filter_subjects)}, has "
                    f"{sorted(d.spec.filter_subjects)}); run with the configuration it was made with, or a new run name"
                )
            # As on the server: ack_wait, max_deliver and max_ack_pending are updated in place; the
            # durable keeps its position (its deliver policy only ever applied at creation).
            d.spec = replace(spec, deliver_policy=d.spec.deliver_policy)
        return d

    def _refuse_overlap(self, spec: ConsumerSpec) -> None:
        for other in self._durables.values():
            if other.spec.stream == spec.stream and any(
                subject_matches(a, b) or subject_matches(b, a)
                for a in other.spec.filter_subjects for b in spec.filter_subjects
            ):
                raise BusConfigError(
                    f"durable {spec.durable!r} overlaps {other.spec.durable!r} on work-queue stream {spec.stream}: "
                    "a work-queue stream allows one consumer per subject; give each pool its own durable"
                )

    @staticmethod
    def _matches(spec: ConsumerSpec, s: _Stored) -> bool:
        return any(subject_matches(f, s.subject) for f in spec.filter_subjects)

    def _candidates(self, d: _Durable) -> list[_Stored]:
        return [s for s in self._streams[d.spec.stream]
                if s.seq >= d.start_seq and s.seq not in d.done and s.seq not in d.parked and self._matches(d.spec, s)]

    def _pending(self, d: _Durable) -> int:
        return sum(1 for s in self._candidates(d) if s.seq not in d.deliveries)

    def _next(self, d: _Durable) -> _Stored | None:
        now = time.monotonic()
        for s in self._candidates(d):
            if s.seq not in d.inflight and d.not_before.get(s.seq, 0.0) <= now:
                d.inflight.add(s.seq)
                d.deliveries[s.seq] = d.deliveries.get(s.seq, 0) + 1
                return s
        return None

    def _next_due(self, d: _Durable) -> float:
        now = time.monotonic()
        dues = [t - now for t in d.not_before.values() if t > now]
        return min(dues) if dues else IDLE_WAIT_S

    def _remove(self, d: _Durable, seq: int) -> None:
        if d.spec.stream in WORK_QUEUES:
            self._streams[d.spec.stream] = [s for s in self._streams[d.spec.stream] if s.seq != seq]
        else:
            d.done.add(seq)
        d.not_before.pop(seq, None)
        self._notify()

    async def _redeliver(self, d: _Durable, s: _Stored, delay: float) -> None:
        if d.deliveries.get(s.seq, 0) >= d.spec.max_deliver:
            d.parked.add(s.seq)  # where the server stops and emits the max-deliveries advisory
            error = d.last_error.pop(s.seq, None) or never_acked(d.deliveries[s.seq])
            await self._dead(d, s, reason="max_deliveries", error=error)
            return
        if delay > 0:
            d.not_before[s.seq] = time.monotonic() + delay
        else:
            d.not_before.pop(s.seq, None)
        self._notify()

    async def _dead(self, d: _Durable, s: _Stored, *, reason: str, error: str) -> None:
        await self.dead_letter(s.subject, s.data, error=error, reason=reason, deliveries=d.deliveries.get(s.seq, 1),
                               headers=s.headers, msg_id=dead_letter_id(d.stream, s.seq), stream_seq=s.seq)
        self._remove(d, s.seq)

    async def _delivery(self, d: _Durable, s: _Stored, decode: Callable[[bytes], Any]) -> Delivery[Any] | None:
        raw: Delivery[bytes] = Delivery(msg=s.data, subject=s.subject, msg_id=s.msg_id, deliveries=d.deliveries[s.seq],
                                        stream_seq=s.seq, headers=dict(s.headers), _settle=_MemSettle(self, d, s))
        return await decoded(raw, decode, self.log)

    def backoff(self, deliveries: int) -> float:
        base, cap = self.error_backoff
        return float(min(base * 2 ** max(deliveries - 1, 0), cap))

    # --- consume -----------------------------------------------------------------------
    def puller(self, spec: ConsumerSpec, decode: Callable[[bytes], T], *, heartbeat: bool = True) -> _MemPuller:
        self._check_open()
        self._durable(spec)
        return _MemPuller(self, spec, decode)

    async def consume(self, spec: ConsumerSpec, decode: Callable[[bytes], T], handler: Handler[T], *,
                      batch: int = 16, concurrency: int = 1) -> None:
        """Handle messages until cancelled; ``concurrency`` at a time; on cancel, running
        handlers get ``shutdown_grace``; raises ``BusClosed`` when the bus closes."""
        self._check_open()
        if batch < 1 or concurrency < 1:
            raise BusError(f"batch ({batch}) and concurrency ({concurrency}) must be >= 1")
        durable = self._durable(spec)
        outcomes: Outcomes[T] = Outcomes(handler, durable=spec.durable, max_deliver=spec.max_deliver,
                                         backoff=self.backoff, note_error=durable.note_error, log=self.log)
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                if self._closed:
                    raise BusClosed(f"bus {self.name!r} closed while consuming {spec.durable!r}")
                if len(running) >= concurrency:
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    continue
                s = self._next(durable)
                if s is None:
                    await self._wait(self._next_due(durable))
                    continue
                d = await self._delivery(durable, s, decode)
                if d is not None:
                    task = asyncio.create_task(self._handle(outcomes, d), name=f"handler-{spec.durable}")
                    running.add(task)
                    task.add_done_callback(running.discard)
        finally:
            await self._stop_handlers(running)

    async def _handle(self, outcomes: Outcomes[Any], d: Delivery[Any]) -> None:
        try:
            await outcomes.run(d)
        except BusClosed:
            pass  # the consume loop sees the closed bus and raises it

    async def _stop_handlers(self, running: set[asyncio.Task[None]]) -> None:
        """The graceful stop: running handlers get ``shutdown_grace``, then are cancelled (-> nak)."""
        if not running:
            return
        await asyncio.wait(running, timeout=self.shutdown_grace)
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    # --- dead letters ----------------------------------------------------------------
    async def dead_letter(self, origin_subject: str, data: bytes, *, error: str, reason: str, deliveries: int = 1,
                          headers: dict[str, str] | None = None, msg_id: str | None = None,
                          stream_seq: int = 0) -> None:
        subject, letter, msg_id = build_dead_letter(
            self.subjects, origin_subject, data, error=error, reason=reason, deliveries=deliveries,
            headers=headers, service=self.name, msg_id=msg_id, stream_seq=stream_seq)
        before = len(self._streams["DEAD"])
        await self.publish(subject, letter.encode(), msg_id=msg_id)
        if len(self._streams["DEAD"]) > before:
            self.dead_letters.append(letter)

    # --- request / serve ---------------------------------------------------------------
    async def request(self, subject: str, data: bytes, *, timeout: float) -> bytes:
        self._check_open()
        for pattern, handler in self._servers:
            if subject_matches(pattern, subject):
                try:
                    async with asyncio.timeout(timeout):
                        return await handler(data)
                except TimeoutError:
                    raise RequestFailed(subject, f"no reply within {timeout}s") from None
                except Exception as exc:  # noqa: BLE001 - reported to the requester, as on the real bus
                    raise RequestFailed(subject, f"the responder failed: {type(exc).__name__}: {exc}") from None
        raise RequestFailed(subject, "no responders (is a service answering this subject running?)")

    async def serve(self, subject: str, handler: Callable[[bytes], Awaitable[bytes]], *, queue: str) -> None:
        self._check_open()
        self._servers.append((subject, handler))

    # --- watch / last ----------------------------------------------------------------
    def watch(self, subject: str, *,
              deliver: Literal["new", "last_per_subject", "all"] = "new") -> AsyncIterator[Delivery[bytes]]:
        self._check_open()
        return _MemWatch(self, subject, deliver)

    async def last(self, subject: str, *, wait: bool = False) -> bytes | None:
        self._check_open()  # never away: ``wait`` has nothing to wait for
        for s in reversed(self._streams[stream_kind_of(subject)]):
            if s.subject == subject:
                return s.data
        return None

    # --- objects / introspection / close ---------------------------------------------
    @property
    def objects(self) -> MemoryObjectStore:
        return self._objects

    def messages(self, kind: str) -> list[tuple[str, bytes]]:
        """Test helper: (subject, data) of every message stored in a stream kind."""
        return [(s.subject, s.data) for s in self._streams[kind]]

    async def streams(self) -> list[StreamState]:
        out = []
        for kind in STREAM_KINDS:
            msgs = self._streams[kind]
            consumers = tuple(self._consumer_state(d) for (k, _), d in self._durables.items() if k == kind)
            out.append(StreamState(name=self.subjects.stream(kind), subjects=(self.subjects.all_of(kind.lower()),),
                                   messages=len(msgs), bytes=sum(len(s.data) for s in msgs), consumers=consumers))
        return out

    async def collect_claims(self, *, margin: float | None = None) -> ClaimsCollected:
        """Nothing to collect: this bus stores every payload in its message (no claim check)."""
        self._check_open()
        return ClaimsCollected(collected=0, markers=0, orphans=0, kept=0, seconds=0.0)

    def _consumer_state(self, d: _Durable) -> ConsumerState:
        unsettled = [s.seq for s in self._candidates(d) if s.seq in d.deliveries]
        return ConsumerState(name=d.spec.durable, pending=self._pending(d), ack_pending=len(unsettled),
                             redelivered=sum(1 for seq in unsettled if d.deliveries[seq] > 1), waiting=0)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in list(self._watches):
            await w.aclose()
        self._notify()
