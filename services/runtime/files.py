"""Files that must survive a crash: written and fsynced, replaced atomically, their folder synced.

One place for the trainer's checkpoints, ledger and version book and the file weight transport,
which all rely on "a reader sees the old content or the new, never a mix, and a rename that
returned is on disk"."""

from __future__ import annotations

import os
from pathlib import Path


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
