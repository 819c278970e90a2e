"""The consumed-group ledger (group id -> "train" or why it was dropped), in memory and on disk.

Every checkpoint must record the whole ledger as of its step (a redelivered committed group is
recognised by it, and a group is acked only once the newest checkpoint records it), but writing
the whole ledger at every checkpoint costs O(groups so far) each time: quadratic over a run.  So
the ledger lives beside the checkpoints, in generations under ``<checkpoints>/ledger/``:

  base-<G>.json     every entry when generation G began (written once, fsynced, renamed)
  journal-<G>.log   append-only: one line per save, the entries added since the previous one

A checkpoint refers to its ledger as ``(G, journal length)``: the base plus the journal's first
``length`` bytes.  Bytes are only ever appended, so an older checkpoint's prefix stays valid after
newer appends, and a crash mid-append leaves a tail no checkpoint refers to.  A save appends only
the entries added since the last save; when the journal outgrows its base (and ``MIN_COMPACT``),
the save starts generation G + 1 from the whole ledger instead.  Compaction then writes about twice
what was appended since the previous one: a bounded number of bytes per checkpoint, amortised.
Each journal line and each base carries its sha256, so corruption is detected on load, and a
generation that no kept checkpoint refers to is deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path

from rlbus.services.runtime.files import fsync_dir, write_synced
from rlbus.services.trainer.errors import TrainerError

MIN_COMPACT = 64 * 1024  # a journal shorter than this is never compacted: tiny bases would churn


class CorruptLedger(TrainerError):
    """A ledger file does not match the digest its checkpoint recorded."""


@dataclass(frozen=True)
class LedgerRef:
    """Where a checkpoint's ledger is: generation, journal prefix length, and the base's digest and size."""

    generation: int
    length: int
    base_sha256: str
    base_bytes: int

    def record(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_record(cls, raw: Mapping[str, object]) -> LedgerRef:
        return cls(int(raw["generation"]), int(raw["length"]), str(raw["base_sha256"]),  # type: ignore[call-overload]
                   int(raw["base_bytes"]))  # type: ignore[call-overload]


class Ledger(MutableMapping[str, str]):
    """The in-memory ledger, which also knows what of it is not on disk yet: ``origin`` is the
    on-disk ledger it extends, ``unsaved`` the entries added or changed since.  A ledger made from
    a plain dict has no origin: its first save writes it whole."""

    def __init__(self, entries: Mapping[str, str] | None = None, *, origin: LedgerRef | None = None) -> None:
        self._entries: dict[str, str] = dict(entries or {})
        self.origin = origin
        self.unsaved: dict[str, str] = {} if origin is not None else dict(self._entries)

    def __getitem__(self, gid: str) -> str:
        return self._entries[gid]

    def __setitem__(self, gid: str, outcome: str) -> None:
        if self._entries.get(gid) != outcome:
            self._entries[gid] = outcome
            self.unsaved[gid] = outcome

    def __delitem__(self, gid: str) -> None:
        raise TypeError(f"ledger entries are never removed (tried {gid!r}): a consumed group stays consumed")

    def __contains__(self, gid: object) -> bool:
        return gid in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Ledger({len(self._entries)} entries, {len(self.unsaved)} unsaved, origin={self.origin})"

    def saved(self, ref: LedgerRef, written: Mapping[str, str]) -> None:
        """``written`` is now on disk as ``ref``, which this ledger extends."""
        self.origin = ref
        for gid, outcome in written.items():
            if self.unsaved.get(gid) == outcome:
                del self.unsaved[gid]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LedgerStore:
    """The generations of ledger files under one folder; written by one trainer at a time."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _base(self, generation: int) -> Path:
        return self.folder / f"base-{generation:08d}.json"

    def _journal(self, generation: int) -> Path:
        return self.folder / f"journal-{generation:08d}.log"

    def generations(self) -> list[int]:
        if not self.folder.exists():
            return []
        return sorted(int(p.stem.removeprefix("base-")) for p in self.folder.glob("base-*.json"))

    def journal_size(self, generation: int) -> int:
        try:
            return self._journal(generation).stat().st_size
        except FileNotFoundError:
            return -1

    def can_extend(self, ref: LedgerRef, more: int) -> bool:
        """Whether ``more`` journal bytes may go on top of ``ref``: nothing was appended after it
        (else the journal holds a lost lineage's entries or a torn line) and no compaction is due."""
        return self.journal_size(ref.generation) == ref.length and ref.length + more <= max(ref.base_bytes, MIN_COMPACT)

    @staticmethod
    def line(entries: Mapping[str, str]) -> bytes:
        body = json.dumps(dict(entries), separators=(",", ":")).encode()
        return _digest(body).encode() + b" " + body + b"\n"

    def append(self, ref: LedgerRef, line: bytes) -> LedgerRef:
        """Append one journal line (made by ``line``) after ``ref``; durable on return."""
        with open(self._journal(ref.generation), "ab") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
        return LedgerRef(ref.generation, ref.length + len(line), ref.base_sha256, ref.base_bytes)

    def start_generation(self, entries: Mapping[str, str]) -> LedgerRef:
        """A new generation whose base is ``entries``; durable on return."""
        self.folder.mkdir(parents=True, exist_ok=True)
        generation = max(self.generations(), default=0) + 1
        data = json.dumps(dict(entries), separators=(",", ":")).encode()
        tmp = self.folder / f"base-{generation:08d}.tmp"
        write_synced(tmp, data)
        with open(self._journal(generation), "wb") as fh:  # empty: no stale tail from a torn earlier try
            os.fsync(fh.fileno())
        os.replace(tmp, self._base(generation))
        fsync_dir(self.folder)
        return LedgerRef(generation, 0, _digest(data), len(data))

    def read(self, ref: LedgerRef) -> dict[str, str]:
        """The ledger ``ref`` names, every byte checked against its digest."""
        try:
            data = self._base(ref.generation).read_bytes()
            with open(self._journal(ref.generation), "rb") as fh:
                journal = fh.read(ref.length)
        except FileNotFoundError as exc:
            raise CorruptLedger(f"ledger generation {ref.generation} is missing a file: {exc}") from None
        if _digest(data) != ref.base_sha256:
            raise CorruptLedger(f"{self._base(ref.generation)} does not match the digest its checkpoint recorded")
        if len(journal) != ref.length:
            raise CorruptLedger(f"{self._journal(ref.generation)} is shorter ({len(journal)} bytes) than its "
                                f"checkpoint recorded ({ref.length})")
        entries: dict[str, str] = json.loads(data)
        for n, raw in enumerate(journal.splitlines()):
            digest, _, body = raw.partition(b" ")
            if _digest(body) != digest.decode(errors="replace"):
                raise CorruptLedger(f"{self._journal(ref.generation)} line {n + 1} does not match its digest")
            entries.update(json.loads(body))
        return entries

    def collect(self, referenced: set[int]) -> None:
        """Delete every generation no kept checkpoint refers to (and half-written bases)."""
        if not self.folder.exists():
            return
        for path in [*self.folder.glob("base-*"), *self.folder.glob("journal-*")]:
            generation = int(path.name.split("-", 1)[1].split(".", 1)[0])
            if generation not in referenced or path.suffix == ".tmp":
                path.unlink(missing_ok=True)
