"""Files that must survive a crash: written and fsynced, replaced atomically, their folder synced.

One place for the trainer's checkpoints, ledger and version book and the file weight transport,
which all rely on "a reader sees the old content or the new, never a mix, and a rename that
returned is on disk"."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it before returning."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make the renames and creations inside folder ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """Replace one file atomically (the old or the new content, never a mix), durably."""
    tmp = path.with_name(path.name + ".tmp")
    write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


class NumberBook:
    """The highest version number a role has handed out, in one JSON file rewritten whole
    (``replace_file``) before the number leaves the role: a restarted role never names two sets
    of weights with one number (reused, its bytes would overwrite the version's file under a
    manifest whose digest no longer matches).  The trainer's ``VersionBook`` adds its forks to
    the record; the speculator's ``DraftBook`` keeps only the number."""

    def __init__(self, path: Path, highest: int = 0) -> None:
        self.path = path
        self.highest = highest

    def reserve(self, version: int) -> None:
        """Record ``version`` as handed out (durable on return); call before it leaves the role."""
        if version > self.highest:
            self.highest = version
            self._write()

    def record(self) -> dict[str, Any]:
        return {"highest": self.highest}

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, json.dumps(self.record()).encode())
