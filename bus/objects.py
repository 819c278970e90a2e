"""The run's object store: weight bytes and claim-checked payloads, over a JetStream bucket.

The bucket layout is the standard JetStream object store (``OBJ_<bucket>`` stream, chunks on
``$O.<bucket>.C.<nuid>``, metadata on ``$O.<bucket>.M.<base64 name>``), so ``nats object`` and
stock clients can read what we write, and we can read theirs.

Why not nats-py's own ``put``/``get``: ``put`` publishes 128 KiB chunks one synchronous round trip
at a time, and ``get`` reads through an ordered push consumer that answers flow control only
every 0.25 s (about 66 MB/s here).  We publish 1 MiB chunks pipelined and read them with an
ephemeral ack-none pull consumer keeping two byte-capped requests in flight, hashing on a worker
thread while the next chunks arrive.  The digest is verified on every read: a mismatch raises
``DigestMismatch`` naming the object and both digests, never returns the bytes.  A name the store
cannot address (``rlbus.bus.protocol.check_object_name``) raises ``BadObjectName`` before any request: an empty one had no
responders, and one past the control-line limit made the server drop the connection for good.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from nats.js import api
from nats.js.errors import APIError, NotFoundError

from rlbus.bus.outage import through_outage
from rlbus.bus.protocol import (
    BusError,
    DigestMismatch,
    ObjectInfo,
    ObjectNotFound,
    ServerUnavailable,
    check_object_name,
)
from rlbus.bus.publish import limit_refusal
from rlbus.bus.pull import PullInbox

T = TypeVar("T")

MiB = 1024 * 1024
CHUNK_SIZE = MiB
# Bytes in flight per transfer, both directions; far below a server's max_pending (64 MiB default).
WINDOW_BYTES = 32 * MiB
_DIGEST_PREFIX = "SHA-256="
_STALL_S = 15.0
# Metadata records per pull of a listing (a few hundred bytes each).
_LIST_BATCH = 1000


@dataclass(frozen=True)
class StoredObject:
    """An object's newest metadata record, as the bucket stores it (``JetStreamObjectStore.stored``)."""

    name: str
    # Server time (epoch seconds) the record was stored: a put writes it after its last chunk,
    # so it is when the object became readable (or, for a delete marker, when it was deleted).
    stored_at: float
    # The record's sequence in the bucket's stream: a later put or delete of the name has a higher one.
    seq: int
    nuid: str  # the token of its chunks' subject
    deleted: bool


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def _chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


def _hex_of(digest_field: str | None) -> str:
    if not digest_field:
        return ""
    b64 = digest_field.split("=", 1)[1] if digest_field.upper().startswith(_DIGEST_PREFIX) else digest_field
    try:
        return base64.urlsafe_b64decode(b64).hex()
    except (ValueError, TypeError):
        return f"<unreadable digest {digest_field!r}>"


class _Hasher:
    """sha256 on a worker thread, fed in order while the event loop moves the next chunks
    (hashlib releases the GIL, so on two cores hashing and transfer overlap).  One worker
    keeps every hasher's updates in submission order."""

    _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlbus-sha256")

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._last: Any = None

    def feed(self, data: bytes | memoryview) -> None:
        self._last = self._pool.submit(self._h.update, data)

    async def hexdigest(self) -> str:
        if self._last is not None:
            await asyncio.wrap_future(self._last)
        return self._h.hexdigest()


class JetStreamObjectStore:
    """``rlbus.bus.protocol.ObjectStore`` over one bucket; created on first use."""

    def __init__(self, nc: Any, js: Any, bucket: str, *, api_prefix: str = "$JS.API",
                 chunk_size: int = CHUNK_SIZE, window_bytes: int = WINDOW_BYTES, max_bytes: int | None = None,
                 replicas: int | None = None,
                 full_error: Callable[[str, str], BusError] | None = None, deadline: float = 30.0,
                 outage: float = 900.0) -> None:
        self._nc = nc
        self._js = js
        self.bucket = bucket
        self.stream = f"OBJ_{bucket}"
        self._api_prefix = api_prefix
        self.chunk_size = chunk_size
        self.window_bytes = window_bytes
        # The bucket's byte cap (0: none; None: keep what the server has).  The bucket discards
        # new: a put past the cap fails (``StreamFull``) instead of dropping another object's chunks.
        self.max_bytes = max_bytes
        # Copies of the bucket in a cluster, like the run's streams (None: keep what the server has).
        self.replicas = replicas
        self._full_error = full_error
        # Every operation is idempotent and rides out a server outage like a publish does.
        self.deadline = deadline
        self.outage = outage
        self._ready = False
        self._lock = asyncio.Lock()

    # --- the operations (each idempotent, retried across an outage) -------------------------
    async def _retrying(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        return await through_outage(op, f"{what} (bucket {self.bucket!r})", connected=lambda: bool(self._nc.is_connected),
                                    deadline=self.deadline, outage=self.outage)

    async def put(self, name: str, data: bytes | bytearray | memoryview) -> ObjectInfo:
        check_object_name(name)
        return await self._retrying(lambda: self._put(name, data), f"object put {name!r}")

    async def get(self, name: str) -> bytes:
        check_object_name(name)
        return await self._retrying(lambda: self._get(name), f"object get {name!r}")

    async def info(self, name: str) -> ObjectInfo:
        check_object_name(name)
        return await self._retrying(lambda: self._info_of(name), f"object info {name!r}")

    async def delete(self, name: str) -> None:
        """Remove ``name``; deleting a missing object is a no-op."""
        check_object_name(name)
        await self._retrying(lambda: self._delete(name), f"object delete {name!r}")

    async def list(self) -> list[ObjectInfo]:
        return await self._retrying(self._list, "object list")

    async def stored(self, prefix: str = "") -> list[StoredObject]:
        """The newest metadata record of every name starting with ``prefix``, delete markers
        included, read in one pass (no payload is read).  An object whose put has not finished
        has no record yet, so it is not listed."""
        return await self._retrying(lambda: self._stored(prefix), f"object listing {prefix!r}")

    async def forget(self, entry: StoredObject) -> None:
        """Remove the object as ``entry`` saw it: its chunks, then its metadata records up to
        ``entry.seq``.  A put of the same name that landed since (a higher sequence, new chunks)
        stays whole, so a name re-written while a collector decided about the old copy is not lost.
        No delete marker is left behind (markers of short-lived names would pile up forever).
        Chunks go first so that a forget cut short leaves the record, and the next one finishes
        it, instead of leaving chunks no record names."""
        check_object_name(entry.name)
        await self._retrying(lambda: self._forget(entry), f"object forget {entry.name!r}")

    async def chunk_sets(self) -> list[str]:
        """The nuid of every set of chunks the bucket holds, whether or not a record names it."""
        return await self._retrying(self._chunk_sets, "chunk listing")

    async def chunks_stored_at(self, nuid: str) -> float | None:
        """Server time the newest chunk of ``nuid`` was stored; None if it has none."""
        return await self._retrying(lambda: self._chunks_stored_at(nuid), f"chunk time of {nuid!r}")

    async def purge_chunks(self, nuid: str) -> None:
        """Remove a set of chunks that no record names (what a put or delete cut short left)."""
        await self._retrying(lambda: self._purge_chunks(nuid), f"chunk purge of {nuid!r}")

    async def _ensure(self) -> None:
        if self._ready:
            return
        async with self._lock:
            if self._ready:
                return
            try:
                info = await self._js.stream_info(self.stream)
            except NotFoundError:
                try:
                    await self._js.create_object_store(self.bucket, config=api.ObjectStoreConfig(
                        storage=api.StorageType.FILE, max_bytes=self.max_bytes or -1, replicas=self.replicas or 1))
                except APIError as exc:
                    if exc.code == 503:  # a cluster electing its leader: ``through_outage`` tries again
                        raise ServerUnavailable(f"object bucket {self.bucket!r}: {exc.description}") from None
                    if exc.err_code != 10058:  # created concurrently by another service
                        raise BusError(f"could not create object bucket {self.bucket!r}: {exc}") from None
            else:
                await self._update_limits(info.config)
            self._ready = True

    async def _update_limits(self, have: api.StreamConfig) -> None:
        """The bucket's byte cap and replica count as configured (each kept when ``None``)."""
        want = dict(max_bytes=self.max_bytes if self.max_bytes else -1, discard=api.DiscardPolicy.NEW)
        if self.max_bytes is None or (have.max_bytes or -1) == want["max_bytes"]:
            want = {}
        if self.replicas is not None and (have.num_replicas or 1) != self.replicas:
            want["num_replicas"] = self.replicas  # raised in place, like the streams (``rlbus.bus.streams``)
        if not want:
            return
        try:
            await self._js.update_stream(replace(have, **want))
        except APIError as exc:
            if exc.code == 503:
                raise ServerUnavailable(f"object bucket {self.bucket!r}: {exc.description}") from None
            raise BusError(f"could not update object bucket {self.bucket!r} to {want}: {exc}; lower "
                           "[run.retention] objects_max_mib, or [run] replicas to at most the cluster's servers"
                           ) from None

    # --- metadata --------------------------------------------------------------------
    async def _info(self, name: str) -> api.ObjectInfo | None:
        try:
            raw = await self._js.get_last_msg(self.stream, _meta_subject(self.bucket, name), direct=True)
        except NotFoundError:
            return None
        try:
            info = api.ObjectInfo.from_response(json.loads(raw.data))
        except (ValueError, TypeError, KeyError) as exc:
            raise BusError(f"object {name!r} in bucket {self.bucket!r} has unreadable metadata: {exc}") from None
        return None if info.deleted else info

    async def _info_of(self, name: str) -> ObjectInfo:
        await self._ensure()
        info = await self._info(name)
        if info is None:
            raise ObjectNotFound(name, self.bucket)
        return ObjectInfo(name=name, size=info.size or 0, sha256=_hex_of(info.digest))

    async def _write_meta(self, info: api.ObjectInfo) -> None:
        await self._js.publish(
            _meta_subject(self.bucket, info.name), json.dumps(info.as_dict()).encode(),
            headers={"Nats-Rollup": "sub"}, timeout=10.0,
        )

    # --- put ---------------------------------------------------------------------------
    async def _check_room(self, name: str, size: int) -> None:
        """Refuse a put that cannot fit under the bucket's byte cap, before any chunk is sent:
        nats-py (2.16) never resolves a ``publish_async`` the server refused, so a chunk refused
        at the cap would only surface as a stall."""
        if self._full_error is None:
            return
        info = await self._js.stream_info(self.stream)
        cap = info.config.max_bytes or -1
        if cap > 0 and info.state.bytes + size > cap:
            raise self._full_error(self.stream, f"maximum bytes exceeded: putting {name!r} ({size} bytes) on the "
                                                f"{info.state.bytes} stored would pass its max_bytes {cap}")

    async def _put(self, name: str, data: bytes | bytearray | memoryview) -> ObjectInfo:
        await self._ensure()
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        size = len(view)
        await self._check_room(name, size)
        old = await self._info(name)
        nuid = self._nc._nuid.next().decode()
        subject = _chunk_subject(self.bucket, nuid)
        hasher = _Hasher()
        window = max(2, self.window_bytes // self.chunk_size)
        pending: set[asyncio.Future[Any]] = set()
        chunks = 0
        try:
            for off in range(0, size, self.chunk_size):
                chunk = bytes(view[off:off + self.chunk_size])
                hasher.feed(chunk)
                pending.add(await self._js.publish_async(subject, chunk))
                chunks += 1
                if len(pending) >= window:
                    done, pending = await asyncio.wait(pending, timeout=_STALL_S,
                                                       return_when=asyncio.FIRST_COMPLETED)
                    if not done:
                        raise ServerUnavailable(f"object put {name!r} stalled: no chunk acknowledged for {_STALL_S:.0f}s")
                    for f in done:
                        f.result()
            if pending:
                done, still = await asyncio.wait(pending, timeout=_STALL_S)
                if still:
                    raise ServerUnavailable(f"object put {name!r} stalled: {len(still)} chunks unacknowledged")
                for f in done:
                    f.result()
            digest = await hasher.hexdigest()
            info = api.ObjectInfo(
                name=name, bucket=self.bucket, nuid=nuid, size=size, chunks=chunks,
                mtime=datetime.now(UTC).isoformat(),
                digest=_DIGEST_PREFIX + base64.urlsafe_b64encode(bytes.fromhex(digest)).decode(),
                options=api.ObjectMetaOptions(max_chunk_size=self.chunk_size),
            )
            await self._write_meta(info)
        except BaseException as exc:
            for f in pending:
                f.cancel()
            try:
                await self._js.purge_stream(self.stream, subject=subject)
            except Exception:  # noqa: BLE001 - best effort; the original error matters
                pass
            if isinstance(exc, APIError) and self._full_error is not None and (why := limit_refusal(exc)):
                raise self._full_error(self.stream, why) from None
            if isinstance(exc, APIError):
                raise BusError(f"object put {name!r} to bucket {self.bucket!r} failed: {exc!r}") from exc
            raise  # timeouts: ``through_outage`` turns them into ServerUnavailable and tries again
        if old is not None and old.nuid != nuid:
            await self._js.purge_stream(self.stream, subject=_chunk_subject(self.bucket, old.nuid))
        return ObjectInfo(name=name, size=size, sha256=digest)

    # --- get ---------------------------------------------------------------------------
    async def _get(self, name: str) -> bytes:
        await self._ensure()
        info = await self._info(name)
        if info is None:
            raise ObjectNotFound(name, self.bucket)
        size, total = info.size or 0, info.chunks or 0
        expected = _hex_of(info.digest)
        if size == 0 or total == 0:
            actual = hashlib.sha256(b"").hexdigest()
            if expected and expected != actual:
                raise DigestMismatch(name, expected, actual)
            return b""
        chunk_size = max(1, -(-size // total))
        window = max(2, self.window_bytes // chunk_size)
        consumer = f"rlbus_get_{self._nc._nuid.next().decode()}"
        await self._js.add_consumer(self.stream, api.ConsumerConfig(
            name=consumer, ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL,
            filter_subject=_chunk_subject(self.bucket, info.nuid), mem_storage=True,
            inactive_threshold=60.0, num_replicas=1,
        ))
        inbox = await PullInbox(self._nc, self._api_prefix, self.stream, consumer).start()
        hasher = _Hasher()
        parts: list[bytes] = []
        loop = asyncio.get_running_loop()
        try:
            requested = got = 0
            last_progress = loop.time()
            while got < total:
                # Two half-window requests in flight: one fills while we drain the other.
                while requested - got <= window // 2 and requested < total:
                    n = min(max(1, window // 2), total - requested)
                    await inbox.request(n, expires=_STALL_S, max_bytes=self.window_bytes)
                    requested += n
                while inbox.buffer:
                    data = inbox.buffer.popleft().data
                    parts.append(data)
                    hasher.feed(data)
                    got += 1
                    last_progress = loop.time()
                for st in list(inbox.statuses.values()):
                    requested -= st.pending_msgs  # expired/cut requests hand back their credit
                inbox.statuses.clear()
                if got >= total:
                    break
                if loop.time() - last_progress > _STALL_S:
                    raise ServerUnavailable(f"object get {name!r} stalled at chunk {got}/{total} for {_STALL_S:.0f}s")
                if not inbox.buffer:
                    await inbox.wait(1.0)
        finally:
            await self._end_reader(inbox, consumer)
        actual = await hasher.hexdigest()
        if actual != expected:
            raise DigestMismatch(name, expected or "<none recorded>", actual)
        data = b"".join(parts)
        if len(data) != size:
            raise BusError(f"object {name!r} read {len(data)} bytes, metadata says {size}")
        return data

    # --- delete / list -----------------------------------------------------------------
    async def _delete(self, name: str) -> None:
        """Remove ``name``; deleting a missing object is a no-op (deletes are retried)."""
        await self._ensure()
        info = await self._info(name)
        if info is None:
            return
        nuid = info.nuid
        info.deleted, info.size, info.chunks, info.digest = True, 0, 0, ""
        info.mtime = datetime.now(UTC).isoformat()
        try:
            await self._write_meta(info)
        finally:
            await self._js.purge_stream(self.stream, subject=_chunk_subject(self.bucket, nuid))

    async def _chunk_sets(self) -> list[str]:
        await self._ensure()
        si = await self._js.stream_info(self.stream, subjects_filter=f"$O.{self.bucket}.C.>")
        return [subject.rsplit(".", 1)[-1] for subject in (si.state.subjects or {})]

    async def _chunks_stored_at(self, nuid: str) -> float | None:
        await self._ensure()
        try:
            raw = await self._js.get_last_msg(self.stream, _chunk_subject(self.bucket, nuid), direct=True)
        except NotFoundError:
            return None
        return raw.time.timestamp() if raw.time is not None else None

    async def _purge_chunks(self, nuid: str) -> None:
        await self._ensure()
        await self._js.purge_stream(self.stream, subject=_chunk_subject(self.bucket, nuid))

    async def _forget(self, entry: StoredObject) -> None:
        await self._ensure()
        if not entry.deleted and entry.nuid:
            await self._js.purge_stream(self.stream, subject=_chunk_subject(self.bucket, entry.nuid))
        await self._js.purge_stream(self.stream, subject=_meta_subject(self.bucket, entry.name), seq=entry.seq + 1)

    async def _stored(self, prefix: str) -> list[StoredObject]:
        """Every name's last metadata record through an ephemeral ack-none consumer (one request per
        ``_LIST_BATCH`` records, not one per object); the record's stream timestamp is the server's."""
        await self._ensure()
        consumer = f"rlbus_list_{self._nc._nuid.next().decode()}"
        created = await self._js.add_consumer(self.stream, api.ConsumerConfig(
            name=consumer, ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            filter_subject=f"$O.{self.bucket}.M.>", mem_storage=True, inactive_threshold=60.0, num_replicas=1,
        ))
        out: list[StoredObject] = []
        inbox = await PullInbox(self._nc, self._api_prefix, self.stream, consumer).start()
        try:
            pending = created.num_pending or 0
            while pending > 0:
                msgs = await inbox.fetch(_LIST_BATCH, _STALL_S, max_bytes=self.window_bytes)
                if not msgs:
                    raise ServerUnavailable(f"object listing of bucket {self.bucket!r} stalled: no metadata record "
                                            f"for {_STALL_S:.0f}s with {pending} still to come")
                for m in msgs:
                    entry = self._entry_of(m)
                    if entry is not None and entry.name.startswith(prefix):
                        out.append(entry)
                pending = msgs[-1].metadata.num_pending
        finally:
            await self._end_reader(inbox, consumer)
        return out

    async def _end_reader(self, inbox: PullInbox, consumer: str) -> None:
        """Stop a chunk or metadata reader and drop its ephemeral consumer."""
        await inbox.stop()
        try:
            await self._js.delete_consumer(self.stream, consumer)
        except Exception:  # noqa: BLE001 - inactive_threshold removes it anyway
            pass

    @staticmethod
    def _entry_of(msg: Any) -> StoredObject | None:
        """A metadata record as a ``StoredObject``; None for one that does not parse (not ours to judge)."""
        try:
            info = api.ObjectInfo.from_response(json.loads(msg.data))
            meta = msg.metadata
        except (ValueError, TypeError, KeyError):
            return None
        if not info.name:
            return None
        return StoredObject(name=info.name, stored_at=meta.timestamp.timestamp(), seq=meta.sequence.stream,
                            nuid=info.nuid or "", deleted=bool(info.deleted))

    async def _list(self) -> list[ObjectInfo]:
        await self._ensure()
        si = await self._js.stream_info(self.stream, subjects_filter=f"$O.{self.bucket}.M.>")
        out = []
        for subject in sorted((si.state.subjects or {}).keys()):
            try:
                raw = await self._js.get_last_msg(self.stream, subject, direct=True)
                info = api.ObjectInfo.from_response(json.loads(raw.data))
            except (NotFoundError, ValueError, KeyError):
                continue
            if not info.deleted:
                out.append(ObjectInfo(name=info.name, size=info.size or 0, sha256=_hex_of(info.digest)))
        return sorted(out, key=lambda o: o.name)
