"""``MemoryBus``: the ``Bus`` Protocol in one process, for handler tests.

What it models faithfully: publish dedupe by msg id (forever, not a time window); work-queue
streams (a message leaves when acked or terminated) and limits streams (kept; each durable
keeps its own position); the handler outcomes of ``JetStreamBus.consume`` (return -> ack,
``Retry`` -> redelivered with ``deliveries`` + 1 after its delay, ``Poison`` -> dead letter,
a decode error -> dead letter with the error text and the handler never called, any other
exception -> redelivered until ``max_deliver``, then dead-lettered with reason
``max_deliveries``); pullers; request/serve; watch/last; an object store that verifies sha256.

What it does not pretend to model: ``ack_wait`` (an unsettled delivery stays in flight until it
is settled — no timed redelivery, no heartbeats needed), byte limits, max_payload and claim
checks, server restarts, ``max_ack_pending``, retention limits (max age, last N per subject).
Delivery semantics are tested against a real server in ``tests/integration``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from bus.protocol import (
    BusClosed,
    BusConfigError,
    BusError,
    ConsumerSpec,
    ConsumerState,
    Delivery,
    DigestMismatch,
    Handler,
    ObjectInfo,
    ObjectNotFound,
    Poison,
    RequestFailed,
    Retry,
    StreamState,
)
from bus.routing import WORK_QUEUES, origin_token, stream_kind_of, subject_matches
from bus.subjects import STREAM_KINDS, Subjects

T = TypeVar("T")


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
    start_seq: int  # first sequence this durable may see
    done: set[int] = field(default_factory=set)  # acked/termed (limits streams)
    inflight: set[int] = field(default_factory=set)
    deliveries: dict[int, int] = field(default_factory=dict)
    not_before: dict[int, float] = field(default_factory=dict)
    last_error: dict[int, str] = field(default_factory=dict)
    parked: set[int] = field(default_factory=set)  # reached max_deliver (dead-lettered)


class _MemSettle:
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

    async def in_progress(self, d: Delivery[Any]) -> None:
        return None


class _MemPuller:
    def __init__(self, bus: MemoryBus, spec: ConsumerSpec, decode: Callable[[bytes], Any]) -> None:
        self.bus, self.spec, self.decode = bus, spec, decode

    async def fetch(self, max_msgs: int, timeout: float) -> list[Delivery[Any]]:
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
            if out or remaining <= 0:
                return out
            await self.bus._wait(min(remaining, self.bus._next_due(durable)))

    async def pending(self) -> int:
        durable = self.bus._durable(self.spec)
        return sum(1 for s in self.bus._candidates(durable) if s.seq not in durable.inflight)


class _MemWatch:
    def __init__(self, bus: MemoryBus, subject: str, deliver: str) -> None:
        self.bus, self.subject = bus, subject
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        kind = stream_kind_of(subject)
        existing = [s for s in bus._streams[kind] if subject_matches(subject, s.subject)]
        if deliver == "all":
            initial = existing
        elif deliver == "last_per_subject":
            initial = list({s.subject: s for s in existing}.values())
        else:
            initial = []
        for s in sorted(initial, key=lambda s: s.seq):
            self.queue.put_nowait(s)
        bus._watches.append(self)

    def offer(self, s: _Stored) -> None:
        if subject_matches(self.subject, s.subject):
            self.queue.put_nowait(s)

    def __aiter__(self) -> _MemWatch:
        return self

    async def __anext__(self) -> Delivery[bytes]:
        s = await self.queue.get()
        if s is None:
            raise StopAsyncIteration
        return Delivery(msg=s.data, subject=s.subject, msg_id=s.msg_id, deliveries=1, stream_seq=s.seq,
                        headers=dict(s.headers), _settle=_NoopSettle())

    async def aclose(self) -> None:
        if self in self.bus._watches:
            self.bus._watches.remove(self)
        self.queue.put_nowait(None)


class _NoopSettle:
    async def ack(self, d: Any) -> None: ...
    async def nak(self, d: Any, delay: float = 0.0) -> None: ...
    async def term(self, d: Any, reason: str) -> None: ...
    async def in_progress(self, d: Any) -> None: ...


class MemoryObjectStore:
    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes, str]] = {}

    async def put(self, name: str, data: bytes | memoryview) -> ObjectInfo:
        b = bytes(data)
        digest = hashlib.sha256(b).hexdigest()
        self._objects[name] = (b, digest)
        return ObjectInfo(name=name, size=len(b), sha256=digest)

    async def get(self, name: str) -> bytes:
        if name not in self._objects:
            raise ObjectNotFound(name)
        b, expected = self._objects[name]
        actual = hashlib.sha256(b).hexdigest()
        if actual != expected:
            raise DigestMismatch(name, expected, actual)
        return b

    async def delete(self, name: str) -> None:
        self._objects.pop(name, None)

    async def list(self) -> list[ObjectInfo]:
        return [ObjectInfo(name=n, size=len(b), sha256=d) for n, (b, d) in sorted(self._objects.items())]

    def corrupt(self, name: str, data: bytes) -> None:
        """Test hook: replace the bytes but keep the recorded digest."""
        self._objects[name] = (data, self._objects[name][1])


class MemoryBus:
    """In-process ``Bus`` for handler tests; see the module docstring for what it models."""

    def __init__(self, run: str = "test", *, name: str = "memory") -> None:
        self.subjects = Subjects(run)
        self.name = name
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
            raise BusClosed("memory bus is closed")

    async def publish(self, subject: str, data: bytes, *, msg_id: str, headers: dict[str, str] | None = None) -> None:
        self._check_open()
        if not msg_id:
            raise BusError("every publish needs a msg_id (it is what makes retries safe)")
        kind = stream_kind_of(subject)
        if msg_id in self._ids[kind]:
            return
        self._ids[kind].add(msg_id)
        h = dict(headers or {})
        h["Nats-Msg-Id"] = msg_id
        s = _Stored(next(self._seq), subject, bytes(data), msg_id, h)
        self._streams[kind].append(s)
        for w in list(self._watches):
            w.offer(s)
        self._notify()

    async def publish_many(self, items: Sequence[tuple[str, bytes, str]], *,
                           headers: dict[str, str] | None = None) -> None:
        for subject, data, msg_id in items:
            await self.publish(subject, data, msg_id=msg_id, headers=headers)

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
            if spec.stream in WORK_QUEUES:
                for other in self._durables.values():
                    if other.spec.stream == spec.stream and any(
                        subject_matches(a, b) or subject_matches(b, a)
                        for a in other.spec.filter_subjects for b in spec.filter_subjects
                    ):
                        raise BusConfigError(
                            f"durable {spec.durable!r} overlaps {other.spec.durable!r} on work-queue stream {spec.stream}"
                        )
            start = 0 if spec.deliver_policy != "new" else next(self._seq)
            d = _Durable(spec, start)
            if spec.deliver_policy == "last_per_subject":
                last = {s.subject: s.seq for s in self._streams[spec.stream] if self._matches(spec, s)}
                d.done.update(s.seq for s in self._streams[spec.stream]
                              if self._matches(spec, s) and s.seq != last[s.subject])
            self._durables[key] = d
        elif d.spec != spec:
            raise BusConfigError(f"durable {spec.durable!r} on {spec.stream} exists with a different spec")
        return d

    @staticmethod
    def _matches(spec: ConsumerSpec, s: _Stored) -> bool:
        return any(subject_matches(f, s.subject) for f in spec.filter_subjects)

    def _candidates(self, d: _Durable) -> list[_Stored]:
        return [s for s in self._streams[d.spec.stream]
                if s.seq >= d.start_seq and s.seq not in d.done and s.seq not in d.parked and self._matches(d.spec, s)]

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
        return min(dues) if dues else 3600.0

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
            await self._dead(d, s, reason="max_deliveries", error=d.last_error.get(
                s.seq, f"delivered {d.deliveries[s.seq]} times without an ack"))
            return
        if delay > 0:
            d.not_before[s.seq] = time.monotonic() + delay
        self._notify()

    async def _dead(self, d: _Durable, s: _Stored, *, reason: str, error: str, remove: bool = True) -> None:
        await self.dead_letter(s.subject, s.data, error=error, reason=reason, deliveries=d.deliveries.get(s.seq, 1),
                               headers=s.headers, msg_id=f"dead.{d.spec.stream}.{s.seq}", stream_seq=s.seq)
        if remove:
            self._remove(d, s.seq)

    async def _delivery(self, d: _Durable, s: _Stored, decode: Callable[[bytes], Any]) -> Delivery[Any] | None:
        settle = _MemSettle(self, d, s)
        try:
            msg = decode(s.data)
        except Exception as exc:  # noqa: BLE001 - any decoder failure is permanent for these bytes
            reason = "schema_error" if type(exc).__name__ == "SchemaError" else "decode_error"
            settle.settled = True
            d.inflight.discard(s.seq)
            await self._dead(d, s, reason=reason, error=f"{type(exc).__name__}: {exc}")
            return None
        return Delivery(msg=msg, subject=s.subject, msg_id=s.msg_id, deliveries=d.deliveries[s.seq],
                        stream_seq=s.seq, headers=dict(s.headers), _settle=settle)

    def puller(self, spec: ConsumerSpec, decode: Callable[[bytes], T], *, heartbeat: bool = True) -> _MemPuller:
        self._check_open()
        self._durable(spec)
        return _MemPuller(self, spec, decode)

    async def consume(self, spec: ConsumerSpec, decode: Callable[[bytes], T], handler: Handler[T], *,
                      batch: int = 16, concurrency: int = 1) -> None:
        """Handle messages until cancelled (or the bus closes); one at a time, in order."""
        durable = self._durable(spec)
        while not self._closed:
            s = self._next(durable)
            if s is None:
                await self._wait(self._next_due(durable))
                continue
            d = await self._delivery(durable, s, decode)
            if d is None:
                continue
            settle: _MemSettle = d._settle
            try:
                await handler(d.msg, d)
            except Retry as r:
                await settle.nak(d, r.delay)
            except Poison as p:
                await settle.term(d, p.reason, error="Poison")
            except asyncio.CancelledError:
                await settle.nak(d, 0.0)
                raise
            except Exception as exc:  # noqa: BLE001 - as on the real bus: retried, then dead-lettered
                durable.last_error[s.seq] = f"{type(exc).__name__}: {exc}"
                await settle.nak(d, 0.0)
            else:
                if not settle.settled:
                    await settle.ack(d)

    # --- dead letters ----------------------------------------------------------------
    async def dead_letter(self, origin_subject: str, data: bytes, *, error: str, reason: str, deliveries: int = 1,
                          headers: dict[str, str] | None = None, msg_id: str | None = None,
                          stream_seq: int = 0) -> None:
        from schemas import DeadLetter

        letter = DeadLetter(origin_subject=origin_subject, error=error, reason=reason, data=bytes(data),
                            deliveries=deliveries, headers=dict(headers or {}), service=self.name,
                            stream_seq=stream_seq, ts=time.time())
        if msg_id is None:
            msg_id = "dead." + hashlib.sha256(f"{origin_subject}\0{reason}\0{error}\0".encode() + bytes(data)).hexdigest()[:32]
        before = len(self._streams["DEAD"])
        await self.publish(self.subjects.dead(origin_token(origin_subject)), letter.encode(), msg_id=msg_id)
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

    async def last(self, subject: str) -> bytes | None:
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
            consumers = tuple(
                ConsumerState(name=d.spec.durable,
                              pending=sum(1 for s in self._candidates(d) if s.seq not in d.inflight),
                              ack_pending=len(d.inflight), redelivered=sum(1 for n in d.deliveries.values() if n > 1),
                              waiting=0)
                for (k, _), d in self._durables.items() if k == kind
            )
            out.append(StreamState(name=self.subjects.stream(kind), subjects=(self.subjects.all_of(kind.lower()),),
                                   messages=len(msgs), bytes=sum(len(s.data) for s in msgs), consumers=consumers))
        return out

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in list(self._watches):
            await w.aclose()
        self._notify()
