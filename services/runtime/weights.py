"""Weight transports: where a version's safetensors bytes live and how they are verified.

Torch-free on purpose (bytes in, bytes out) so weight-broadcast needs no torch.  Two
transports, chosen by a typed config value:
- ``objstore`` (default): the run's JetStream object store; works across machines;
- ``file``: safetensors on a shared path (co-located or shared-FS deployments), written
  atomically (tmp + fsync + rename) and read memory-mapped.
Every read verifies the shard's sha256 against the manifest: a version that does not verify is
never swapped in.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import Protocol

from bus.protocol import Bus
from schemas import Shard


class WeightIntegrityError(RuntimeError):
    """Bytes of a shard do not match the manifest's sha256: refuse the version."""

    def __init__(self, shard: Shard, actual: str) -> None:
        self.shard, self.actual = shard, actual
        super().__init__(
            f"weight shard {shard.name!r} at {shard.location!r}: sha256 {actual[:16]}… does not match the "
            f"manifest's {shard.sha256[:16]}…; the version is refused (re-publish it from the trainer)"
        )


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
        verify(shard, data)
        return data

    async def delete(self, shard: Shard) -> None:
        await self.bus.objects.delete(shard.location)


class FileTransport:
    name = "file"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    async def write(self, location: str, data: bytes) -> Shard:
        path = self.root / location
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return Shard(name=path.name, sha256=sha256_of(data), size=len(data), location=str(path))

    async def read(self, shard: Shard) -> memoryview:
        with open(shard.location, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(mm)
        verify(shard, view)
        return view

    async def delete(self, shard: Shard) -> None:
        Path(shard.location).unlink(missing_ok=True)


def make_transport(kind: str, *, bus: Bus, root: str | Path) -> WeightTransport:
    if kind == "objstore":
        return ObjectStoreTransport(bus)
    if kind == "file":
        return FileTransport(root)
    raise ValueError(f"unknown weight transport {kind!r}; use 'objstore' or 'file'")
