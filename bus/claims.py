"""Claim check: payloads too large for a message travel through the run's object store.

A payload above the connection's ``claim_threshold`` (default: the server's ``max_payload``
less 512 KiB of headroom for headers) is written to the object store as
``claims/<STREAM>/<msg_id>`` (``STREAM``: the kind of stream its subject is stored on, e.g.
``SCORED``) and a small reference message (header ``Rlbus-Claim``) is published instead.  Every
read path (consume, puller, watch, last, dead letters) resolves it, so callers only ever see the
original bytes.

Two ways a claim goes:

- a work-queue message's claim is deleted once the message is acked or terminated (``release``);
- every other claim, and any a release missed (a crash between ack and delete), is deleted by
  ``ClaimCollector`` once no message its stream still holds can reference it.  A claim is
  written before its message is published, and that publish ends (stored or given up) within
  the publish deadline plus the outage budget.  So a claim stored more than that ``margin``
  (plus clock slack) before the oldest message its stream still holds belongs to a message
  that is gone: limits drop oldest first, and a work queue's oldest message is its oldest
  un-acked one.  The collector reads only the bucket's metadata records and each stream's
  first/last timestamps, all on the server's clock; it never reads a payload.

The same pass removes chunks that no metadata record names and that were last written more than
the margin ago: what a put (of a claim or a weight file) or a delete cut short by a kill leaves.
A put in progress writes its chunks, then its record within seconds, so it is never one of them.

Names written before claims carried their stream (``claims/<msg_id>``) are judged against the
oldest message of every stream, so they are kept as long as anything that old is.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from nats.js.errors import APIError

from rlbus.bus.outage import through_outage
from rlbus.bus.protocol import BusConfigError, BusError, ClaimsCollected, DigestMismatch, ObjectNotFound, ObjectStore
from rlbus.bus.routing import stream_kind_of
from rlbus.bus.subjects import STREAM_KINDS, Subjects

if TYPE_CHECKING:  # rlbus.bus.objects imports rlbus.bus.publish, which imports this module
    from rlbus.bus.objects import JetStreamObjectStore, StoredObject

CLAIM_HEADER = "Rlbus-Claim"
CLAIM_SIZE_HEADER = "Rlbus-Claim-Size"
CLAIM_PREFIX = "claims/"
# Server clocks of a cluster (the bucket's and a stream's leaders) may disagree by this much, and a
# server may store a publish a little after the client stopped waiting for it.
CLOCK_SLACK_S = 60.0
_NO_TIME = datetime.fromisoformat("0001-01-01T00:00:00Z").timestamp()  # the server's "never"


def claim_name(subject: str, msg_id: str) -> str:
    """``claims/<STREAM>/<msg_id>``: the stream in the name is what lets the collector judge a
    claim against the messages of that stream alone (CONTROL keeps a run's first decisions
    forever; they must not hold back SCORED's claims)."""
    try:
        kind = stream_kind_of(subject)
    except BusConfigError:
        return f"{CLAIM_PREFIX}{msg_id}"  # no stream of the run stores it: judged like an old name
    return f"{CLAIM_PREFIX}{kind}/{msg_id}"


def claim_stream(name: str) -> str | None:
    """The stream kind a claim name records, or None (an older name without one)."""
    kind, sep, _ = name[len(CLAIM_PREFIX):].partition("/")
    return kind if sep and kind in STREAM_KINDS else None


class ClaimCheck:
    """Writes, resolves and releases claimed payloads in one object store."""

    def __init__(self, objects: ObjectStore, *, spawn: Callable[..., asyncio.Task[Any]], log: Any) -> None:
        self.objects = objects
        self._spawn = spawn
        self.log = log

    async def put(self, subject: str, msg_id: str, data: bytes,
                  headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
        """Store ``data``; returns the (empty) payload and the headers of the reference message."""
        name = claim_name(subject, msg_id)
        info = await self.objects.put(name, data)
        headers = dict(headers)
        headers[CLAIM_HEADER] = name
        headers[CLAIM_SIZE_HEADER] = str(info.size)
        return b"", headers

    async def resolve(self, data: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str], str | None]:
        """(original bytes, headers without the claim headers, claim name or None)."""
        name = headers.get(CLAIM_HEADER)
        if name is None:
            return data, headers, None
        body = await self.objects.get(name)
        headers = {k: v for k, v in headers.items() if k not in (CLAIM_HEADER, CLAIM_SIZE_HEADER)}
        return body, headers, name

    @staticmethod
    def is_gone(exc: BaseException) -> bool:
        """Whether a resolve failure is permanent (the claimed bytes are missing or corrupt)."""
        return isinstance(exc, (ObjectNotFound, DigestMismatch))

    def release(self, name: str) -> None:
        """Delete a claim in the background (its message is gone for good)."""
        self._spawn(self._delete(name), name=f"release-{name}")

    async def _delete(self, name: str) -> None:
        try:
            await self.objects.delete(name)
        except Exception as exc:  # noqa: BLE001 - a leftover claim costs bytes, not correctness
            self.log.warning("claim_release_failed", claim=name, error=repr(exc))


@dataclass(frozen=True)
class StreamTimes:
    """When a stream's oldest held message and its newest ever message were stored (server clock)."""

    messages: int
    first: float
    last: float | None  # None: the stream never stored a message


class ClaimFloors:
    """Per stream kind, the time before which (less the margin) a claim is unreachable."""

    def __init__(self, times: dict[str, StreamTimes]) -> None:
        lasts = [t.last for t in times.values() if t.last is not None]
        # The newest time any stream stored something: a lower bound of "now" on the server's clock
        # when the streams were read.  An empty stream's claims are judged against it.
        self.seen = max(lasts) if lasts else None
        self.by_kind: dict[str, float | None] = {
            kind: (t.first if t.messages > 0 else self.seen) for kind, t in times.items()}
        known = list(self.by_kind.values())
        # A name without its stream could belong to any: the oldest floor of all (None if any is None).
        self.any = None if not known or None in known else min(v for v in known if v is not None)

    def of(self, name: str) -> float | None:
        kind = claim_stream(name)
        return self.any if kind is None else self.by_kind.get(kind, self.any)


class ClaimCollector:
    """Deletes the claims no retained message can reference any more (see the module docstring).

    Safe to run from any number of places at once and across restarts: it keeps no state, and
    deleting is ``JetStreamObjectStore.forget``, which leaves a copy re-written meanwhile whole."""

    def __init__(self, objects: JetStreamObjectStore, *, nc: Any, api_prefix: str, subjects: Subjects,
                 margin: float, deadline: float, outage: float, log: Any) -> None:
        self.objects = objects
        self._nc = nc
        self._api_prefix = api_prefix
        self.subjects = subjects
        self.margin = margin  # the longest a publish may take after its claim is stored, plus clock slack
        self.deadline = deadline
        self.outage = outage
        self.log = log

    async def collect(self, *, margin: float | None = None) -> ClaimsCollected:
        """One pass.  The streams are read *before* the claims: a message stored after that read
        cannot move a floor, and its claim is then newer than the floor anyway.  Any refusal by
        the server is a ``BusError``: a failed pass must not stop the service running it."""
        try:
            return await self._collect(self.margin if margin is None else margin)
        except APIError as exc:
            raise BusError(f"claim collection in bucket {self.objects.bucket!r} failed: {exc!r}; the next pass "
                           "tries again (until then unreachable claims only take space)") from exc

    async def _collect(self, margin: float) -> ClaimsCollected:
        t0 = time.monotonic()
        floors = ClaimFloors(await self.stream_times())
        collected = markers = kept = 0
        stored = await self.objects.stored()
        for entry in stored:
            if not entry.name.startswith(CLAIM_PREFIX):
                continue
            if entry.deleted:
                # A released claim's delete marker: nothing reads it, and one per message piles up.
                await self.objects.forget(entry)
                markers += 1
            elif self.unreachable(entry, floors, margin):
                await self.objects.forget(entry)
                collected += 1
                self.log.debug("claim_collected", claim=entry.name)
            else:
                kept += 1
        orphans = await self.collect_orphans(stored, floors, margin)
        result = ClaimsCollected(collected=collected, markers=markers, orphans=orphans, kept=kept,
                                 seconds=time.monotonic() - t0)
        self.log.info("claims_collected", collected=collected, markers=markers, orphans=orphans, kept=kept,
                      seconds=round(result.seconds, 3), margin_s=margin)
        return result

    async def collect_orphans(self, stored: list[StoredObject], floors: ClaimFloors, margin: float) -> int:
        """Purge the chunks no record in ``stored`` names, last written over ``margin`` before the
        streams were read.  Chunks listed after ``stored`` that belong to a put finishing meanwhile
        are young, so they stay."""
        if floors.seen is None:
            return 0
        named = {e.nuid for e in stored if not e.deleted}
        orphans = 0
        for nuid in await self.objects.chunk_sets():
            if nuid in named:
                continue
            written = await self.objects.chunks_stored_at(nuid)
            if written is not None and written < floors.seen - margin:
                await self.objects.purge_chunks(nuid)
                orphans += 1
                self.log.info("orphaned_chunks_removed", nuid=nuid)
        return orphans

    @staticmethod
    def unreachable(entry: StoredObject, floors: ClaimFloors, margin: float) -> bool:
        floor = floors.of(entry.name)
        return floor is not None and entry.stored_at < floor - margin

    async def stream_times(self) -> dict[str, StreamTimes]:
        return await through_outage(self._stream_times, "stream times for claim collection",
                                    connected=lambda: bool(self._nc.is_connected),
                                    deadline=self.deadline, outage=self.outage)

    async def _stream_times(self) -> dict[str, StreamTimes]:
        """Each run stream's first and last timestamps.  nats-py's ``StreamState`` drops them, so
        the API's own answer is read."""
        out = {}
        for kind in STREAM_KINDS:
            stream = self.subjects.stream(kind)
            reply = await self._nc.request(f"{self._api_prefix}.STREAM.INFO.{stream}", b"", timeout=10.0)
            resp = json.loads(reply.data)
            err = resp.get("error")
            if err is not None:
                if err.get("code") == 404:  # not declared yet: it holds nothing
                    out[kind] = StreamTimes(messages=0, first=_NO_TIME, last=None)
                    continue
                raise BusError(f"stream info of {stream!r} for claim collection failed: {err}; "
                               "check this service may read the run's streams")
            state = resp.get("state", {})
            last = datetime.fromisoformat(state.get("last_ts") or "0001-01-01T00:00:00Z").timestamp()
            out[kind] = StreamTimes(
                messages=int(state.get("messages", 0)),
                first=datetime.fromisoformat(state.get("first_ts") or "0001-01-01T00:00:00Z").timestamp(),
                last=None if last <= _NO_TIME else last)
        return out
