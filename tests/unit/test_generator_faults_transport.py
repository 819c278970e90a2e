"""The file weight transport touches only its weight directory, and never hashes or fsyncs on the event loop.

A manifest is a message anyone on the bus could publish: a location in it that points outside the
run's directory (an absolute path, ``..``, a symlink that escapes) must be refused with an error
that says where weights belong, and must neither be read nor deleted.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from rlbus.schemas import Shard
from rlbus.services.runtime import weights as weights_module
from rlbus.services.runtime.weights import FileTransport, WeightIntegrityError, WeightLocationError


def _shard(location: str | Path, data: bytes) -> Shard:
    return Shard(name="model.safetensors", sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                 location=str(location))


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """(the run's directory, a file outside it whose bytes a forged manifest could name)."""
    root = tmp_path / "run"
    root.mkdir()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"not yours")
    return root, victim


async def test_weights_round_trip_inside_the_directory(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    transport = FileTransport(root)
    shard = await transport.write("weights/policy/v00000001/model.safetensors", b"v1 bytes")
    assert Path(shard.location).is_relative_to(root.resolve()) and Path(shard.location).read_bytes() == b"v1 bytes"
    assert bytes(await transport.read(shard)) == b"v1 bytes"
    relative = _shard("weights/policy/v00000001/model.safetensors", b"v1 bytes")  # relative to the directory
    assert bytes(await transport.read(relative)) == b"v1 bytes"
    await transport.delete(shard)
    assert not Path(shard.location).exists()


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink_file", "symlink_dir", "checkpoint"])
async def test_a_location_outside_the_directory_is_neither_read_nor_deleted(layout: tuple[Path, Path],
                                                                           how: str) -> None:
    root, victim = layout
    if how == "absolute":
        location = str(victim)
    elif how == "dotdot":
        location = "weights/../../victim.bin"
    elif how == "symlink_file":
        (root / "weights").mkdir()
        (root / "weights" / "link.safetensors").symlink_to(victim)
        location = str(root / "weights" / "link.safetensors")
    elif how == "symlink_dir":
        (root / "weights").symlink_to(victim.parent)
        location = "weights/victim.bin"
    else:  # inside the run, outside its weights: e.g. the trainer's checkpoint pointer
        victim = root / "checkpoints" / "latest"
        victim.parent.mkdir()
        victim.write_bytes(b"not yours")
        location = str(victim)
    transport = FileTransport(root)
    shard = _shard(location, b"not yours")  # the digest even matches
    with pytest.raises(WeightLocationError, match="outside it") as err:
        await transport.read(shard)
    assert str(root.resolve() / "weights") in str(err.value) and isinstance(err.value, WeightIntegrityError)
    with pytest.raises(WeightLocationError):
        await transport.delete(shard)
    with pytest.raises(WeightLocationError):
        await transport.write(location, b"overwrite")
    assert victim.read_bytes() == b"not yours"


async def test_a_tampered_file_is_refused_by_its_digest(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    transport = FileTransport(root)
    shard = await transport.write("weights/v1.safetensors", b"v1 bytes")
    Path(shard.location).write_bytes(b"")  # even an empty file (mmap refuses those)
    with pytest.raises(WeightIntegrityError, match="sha256"):
        await transport.read(shard)


async def test_hashing_and_fsync_run_off_the_event_loop(layout: tuple[Path, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = layout
    loop_thread = threading.current_thread()
    seen: list[tuple[str, bool]] = []
    real_sha, real_fsync = weights_module.sha256_of, os.fsync

    def sha256_of(data: bytes | memoryview) -> str:
        seen.append(("sha256", threading.current_thread() is loop_thread))
        return real_sha(data)

    def fsync(fd: int) -> None:
        seen.append(("fsync", threading.current_thread() is loop_thread))
        real_fsync(fd)

    monkeypatch.setattr(weights_module, "sha256_of", sha256_of)
    monkeypatch.setattr(weights_module.os, "fsync", fsync)
    transport = FileTransport(root)
    shard = await transport.write("weights/v1.safetensors", b"v1 bytes")
    await transport.read(shard)
    assert {kind for kind, _ in seen} == {"sha256", "fsync"}
    assert not any(on_loop for _, on_loop in seen), f"ran on the event loop: {seen}"
