"""Weight transports: where a version's safetensors bytes live and how they are verified.

Torch-free on purpose (bytes in, bytes out) so weight-broadcast needs no torch.  Two
transports, chosen by a typed config value:
- ``objstore`` (default): the run's JetStream object store; works across machines;
- ``file``: safetensors on a shared path (co-located or shared-FS deployments), written
  atomically (tmp + fsync + rename) and read memory-mapped.  Only paths inside the run's
  weight directory are read, written or deleted: a manifest is a message anyone on the bus
  could forge, and a path in it must not make a service read or delete other files.
Every read verifies the shard's sha256 against the manifest: a version that does not verify is
never swapped in.  Hashing and fsync take a worker thread: on the event loop they would stall
heartbeats, acks and in-progress signals for as long as a large model takes to hash.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
from pathlib import Path
from typing import Protocol

from rlbus.bus.protocol import Bus
from rlbus.schemas import Shard
from rlbus.services.runtime.files import write_synced


class WeightIntegrityError(RuntimeError):
    """Bytes of a shard do not match the manifest's sha256: refuse the version."""

    def __init__(self, shard: Shard, actual: str) -> None:
        self.shard, self.actual = shard, actual
        super().__init__(
            f"weight shard {shard.name!r} at {shard.location!r}: sha256 {actual[:16]}… does not match the "
            f"manifest's {shard.sha256[:16]}…; the version is refused (re-publish it from the trainer)"
        )


class WeightLocationError(WeightIntegrityError):
    """A shard's location lies outside the transport's weight directory: refuse the version.
    (A ``WeightIntegrityError``, so every reader that refuses a forged version refuses this one.)"""

    def __init__(self, shard: Shard | None, location: str, weights_dir: Path, why: str) -> None:
        self.shard, self.actual = shard, ""  # type: ignore[assignment]
        self.location, self.weights_dir = location, weights_dir
        RuntimeError.__init__(
            self, f"weight location {location!r} {why}; the file transport only touches files under the run's "
                  f"weight directory {str(weights_dir)!r}: write weights there (a location relative to the run "
                  "directory such as 'weights/<model>/v1/model.safetensors', or a path inside it)")


class WeightTransport(Protocol):
    name: str

    async def write(self, location: str, data: bytes) -> Shard: ...

    async def read(self, shard: Shard) -> bytes | memoryview: ...

    async def delete(self, shard: Shard) -> None: ...


def sha256_of(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def verify(shard: Shard, data: bytes | memoryview) -> None:
    actual = sha256_of(data)
    if actual != shard.sha256:
        raise WeightIntegrityError(shard, actual)


class ObjectStoreTransport:
    name = "objstore"

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def write(self, location: str, data: bytes) -> Shard:
        info = await self.bus.objects.put(location, data)
        return Shard(name=Path(location).name, sha256=info.sha256, size=info.size, location=location)

    async def read(self, shard: Shard) -> bytes:
        data = await self.bus.objects.get(shard.location)
        await asyncio.to_thread(verify, shard, data)
        return data

    async def delete(self, shard: Shard) -> None:
        await self.bus.objects.delete(shard.location)


class FileTransport:
    """Shards as files under ``<root>/weights`` (``root`` is the run's directory, shared by the
    services of a run).  A location is a path relative to ``root`` (``weights/<model>/v…/…``, as
    the trainer writes it) or an absolute path; resolved, symlinks included, it must lie inside the
    weight directory, so a forged manifest can neither read nor delete the run's checkpoints or
    anything outside the run."""

    name = "file"
    SUBDIR = "weights"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.weights_dir = self.root / self.SUBDIR  # not resolved: a symlink here would lead out of the run

    def path_of(self, location: str, shard: Shard | None = None) -> Path:
        """The resolved path of ``location``; raises ``WeightLocationError`` unless it is inside the weight directory."""
        if not location or "\0" in location:
            raise WeightLocationError(shard, location, self.weights_dir, "is empty or holds a NUL byte")
        raw = Path(location)
        resolved = (raw if raw.is_absolute() else self.root / raw).resolve()
        if resolved == self.weights_dir or not resolved.is_relative_to(self.weights_dir):
            raise WeightLocationError(shard, location, self.weights_dir, f"resolves to {str(resolved)!r}, outside it")
        return resolved

    async def write(self, location: str, data: bytes) -> Shard:
        path = self.path_of(location)
        sha256 = await asyncio.to_thread(self._write, path, data)
        return Shard(name=path.name, sha256=sha256, size=len(data), location=str(path))

    @staticmethod
    def _write(path: Path, data: bytes) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        write_synced(tmp, data)
        os.replace(tmp, path)
        return sha256_of(data)

    async def read(self, shard: Shard) -> memoryview:
        path = self.path_of(shard.location, shard)
        return await asyncio.to_thread(self._read, path, shard)

    @staticmethod
    def _read(path: Path, shard: Shard) -> memoryview:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:  # mmap refuses an empty file; its digest still decides
                view = memoryview(b"")
            else:
                view = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
        verify(shard, view)
        return view

    async def delete(self, shard: Shard) -> None:
        path = self.path_of(shard.location, shard)
        await asyncio.to_thread(path.unlink, missing_ok=True)


def make_transport(kind: str, *, bus: Bus, root: str | Path) -> WeightTransport:
    if kind == "objstore":
        return ObjectStoreTransport(bus)
    if kind == "file":
        return FileTransport(root)
    raise ValueError(f"unknown weight transport {kind!r}; use 'objstore' or 'file'")
