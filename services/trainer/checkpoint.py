"""Durable checkpoints: model, optimiser, step, version, counters, and the ledger of consumed groups.

At every instant a complete checkpoint exists to resume from.  A save writes a new folder
``step-<N>.tmp`` (every file fsynced, a manifest of their sha256 last), renames it to a name no
other checkpoint has (``step-<N>``, or ``step-<N>-<seq>`` when the same step is saved again), and
only then points ``latest`` at it and deletes checkpoints beyond the ``keep`` newest (never fewer
than two, so a corrupt newest one leaves the previous to fall back to).  Nothing is deleted or
overwritten before its replacement is complete, so a kill at any point leaves the previous
checkpoint intact.  ``load_latest`` takes the newest checkpoint (by write order, ``seq``) whose
every file matches its digest, and sets aside (``.corrupt``) one that does not.

The ledger of consumed group ids is not written whole into each checkpoint: each checkpoint
refers to an append-only ledger beside it (ledger.py), so a checkpoint writes only the entries
added since the previous one.  The trainer acks the messages a checkpoint covers only once the
checkpoint after it is saved too (commit.py), so whichever of the two newest a restart resumes
from, it recognises every acked group as consumed.  Groups dropped while no batch fills trained
nothing, so a ledger-only save (``save_ledger``) gives their entries to both: appended to the
newest one's ledger, and to the one before it in a small side file (``dropped.log``) that
loading merges into that checkpoint's ledger.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rlbus.observability.logging import get_logger
from rlbus.services.runtime.files import fsync_dir, replace_file, write_synced
from rlbus.services.trainer.errors import TrainerError
from rlbus.services.trainer.ledger import CorruptLedger, Ledger, LedgerRef, LedgerStore

log = get_logger()

MODEL, OPTIMIZER, STATE, LEDGER, MANIFEST = "model.safetensors", "optimizer.pt", "state.json", "ledger.json", "manifest.json"
DROPPED = "dropped.log"  # drops a ledger-only save gave this checkpoint after a newer one was written
KEEP_AT_LEAST = 2  # the newest and the one before it: what a corrupt newest checkpoint falls back to
LEGACY = -1  # the write order of a folder written before manifests existed (older than any other)


class CorruptCheckpoint(TrainerError):
    """A checkpoint file is missing or does not match the digest its manifest recorded."""


# What reading a damaged checkpoint can raise: it is then set aside, and the previous one is used.
# (RuntimeError: torch.load of a truncated file.  A model that does not fit raises outside of it.)
DAMAGED = (CorruptCheckpoint, CorruptLedger, OSError, ValueError, KeyError, TypeError, EOFError, RuntimeError,
           pickle.UnpicklingError, SafetensorError)


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    consumed: Ledger = field(default_factory=Ledger)  # group id -> "train" | drop reason
    counters: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.consumed, Ledger):  # a plain dict: not on disk yet
            self.consumed = Ledger(self.consumed)


@dataclass(frozen=True)
class Found:
    """A checkpoint folder on disk (complete unless damaged since)."""

    folder: Path
    seq: int  # write order
    step: int


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


def checkpoints(root: Path) -> list[Found]:
    """Every checkpoint folder, newest (last written) first; not the half-written or set-aside ones."""
    found = []
    for p in root.glob("step-*") if root.exists() else ():
        if not p.is_dir() or p.suffix in (".tmp", ".corrupt") or not p.name[5:13].isdigit():
            continue
        seq = LEGACY
        if (p / MANIFEST).exists():
            try:
                seq = int(json.loads((p / MANIFEST).read_text())["seq"])
            except DAMAGED:
                seq = LEGACY - 1  # tried last; loading it will fail and set it aside
        found.append(Found(p, seq, int(p.name[5:13])))
    return sorted(found, key=lambda f: (f.seq, f.step), reverse=True)


def _ledger_ref(folder: Path) -> LedgerRef:
    return LedgerRef.from_record(json.loads((folder / LEDGER).read_text()))


def _save_ledger_of(root: Path, ledger: Ledger) -> tuple[LedgerRef, dict[str, str]]:
    """Put ``ledger`` on disk: append what is unsaved to the ledger it extends, or (no origin, a
    journal someone appended to since, or a compaction due) start a generation with all of it."""
    store = LedgerStore(root / "ledger")
    delta = dict(ledger.unsaved)
    if ledger.origin is not None:
        if not delta:
            return ledger.origin, delta
        line = store.line(delta)
        if store.can_extend(ledger.origin, len(line)):
            return store.append(ledger.origin, line), delta
    return store.start_generation(ledger), delta


def _free_name(root: Path, step: int, seq: int) -> Path:
    first = root / f"step-{step:08d}"
    return first if not first.exists() else root / f"step-{step:08d}-{seq}"


def _point(root: Path, folder: Path) -> None:
    """``latest`` names the newest checkpoint, for readers outside the trainer (export, status)."""
    replace_file(root / "latest", _json({"checkpoint": folder.name}))


def save(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState, *, keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    seq = max((f.seq for f in checkpoints(root)), default=0) + 1
    ref, written = _save_ledger_of(root, state.consumed)
    tmp = root / f"step-{state.step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a save a crash interrupted: never complete, never loaded
    tmp.mkdir()
    optimizer_bytes = io.BytesIO()
    # Optimiser state is tensors + numbers only, so it loads back with weights_only=True.
    torch.save(optimizer.state_dict(), optimizer_bytes)
    files = {
        # Clone tensors: tied or shared storages cannot be saved by safetensors as aliases.
        MODEL: save_safetensors({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}),
        OPTIMIZER: optimizer_bytes.getvalue(),
        STATE: _json({"step": state.step, "version": state.version, "counters": state.counters}),
    }
    for name, data in files.items():
        write_synced(tmp / name, data)
    write_synced(tmp / LEDGER, _json(ref.record()))  # not in the manifest: a ledger-only save replaces it
    write_synced(tmp / MANIFEST, _json({"seq": seq, "step": state.step,
                                  "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}))
    fsync_dir(tmp)
    final = _free_name(root, state.step, seq)
    os.replace(tmp, final)
    fsync_dir(root)
    _point(root, final)
    state.consumed.saved(ref, written)
    _retain(root, keep)
    return final


def _retain(root: Path, keep: int) -> None:
    """Delete checkpoints beyond the newest ``keep`` (at least two), leftovers of interrupted saves,
    and ledger generations no kept checkpoint refers to."""
    found = checkpoints(root)
    kept, old = found[: max(keep, KEEP_AT_LEAST)], found[max(keep, KEEP_AT_LEAST):]
    for f in old:
        shutil.rmtree(f.folder, ignore_errors=True)
    for tmp in root.glob("step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    referenced = set()
    for f in kept:
        if f.seq == LEGACY:
            continue
        try:
            referenced.add(_ledger_ref(f.folder).generation)
        except DAMAGED:
            return  # which generation it needs is unknown: delete none
    LedgerStore(root / "ledger").collect(referenced)


def _read_verified(folder: Path) -> dict[str, bytes]:
    """Every file the manifest lists, each checked against its digest."""
    manifest = json.loads((folder / MANIFEST).read_text())
    blobs = {}
    for name, digest in manifest["sha256"].items():
        path = folder / name
        if not path.exists():
            raise CorruptCheckpoint(f"{path} is missing")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise CorruptCheckpoint(f"{path} does not match the sha256 in its manifest (damaged on disk)")
        blobs[name] = data
    return blobs


def _append_dropped(folder: Path, entries: Mapping[str, str]) -> None:
    """Give an older checkpoint the entries of groups dropped since (they fit any model); durable on return."""
    path = folder / DROPPED
    new = not path.exists()
    with open(path, "ab") as fh:
        fh.write(LedgerStore.line(entries))
        fh.flush()
        os.fsync(fh.fileno())
    if new:
        fsync_dir(folder)


def _read_dropped(folder: Path) -> dict[str, str]:
    """The entries ``_append_dropped`` gave ``folder``.  A last line without its newline is an
    append a crash interrupted (its groups were never acked): ignored.  A whole line that does not
    match its digest is damage."""
    path = folder / DROPPED
    if not path.exists():
        return {}
    lines = path.read_bytes().split(b"\n")[:-1]  # the last piece is empty, or a torn append
    entries: dict[str, str] = {}
    for n, raw in enumerate(lines):
        digest, _, body = raw.partition(b" ")
        if hashlib.sha256(body).hexdigest() != digest.decode(errors="replace"):
            raise CorruptLedger(f"{path} line {n + 1} does not match its digest (damaged on disk)")
        entries.update(json.loads(body))
    return entries


def _read(root: Path, found: Found, *, with_model: bool) -> tuple[TrainerState, dict[str, torch.Tensor], object]:
    """State, model tensors and optimiser state of one checkpoint; raises one of ``DAMAGED``."""
    state, tensors, optimizer_state = _read_files(root, found, with_model=with_model)
    for gid, reason in _read_dropped(found.folder).items():
        state.consumed.setdefault(gid, reason)  # unsaved: the next save must write them
    return state, tensors, optimizer_state


def _read_files(root: Path, found: Found, *, with_model: bool) -> tuple[TrainerState, dict[str, torch.Tensor], object]:
    folder = found.folder
    if found.seq == LEGACY:  # written before manifests: the whole ledger is in state.json
        raw = json.loads((folder / STATE).read_text())
        state = TrainerState(raw["step"], raw["version"], Ledger(raw["consumed"]), raw["counters"])
        if not with_model:
            return state, {}, None
        return (state, load_safetensors((folder / MODEL).read_bytes()),
                torch.load(folder / OPTIMIZER, weights_only=True))
    blobs = _read_verified(folder)
    raw = json.loads(blobs[STATE])
    ref = _ledger_ref(folder)
    state = TrainerState(raw["step"], raw["version"], Ledger(LedgerStore(root / "ledger").read(ref), origin=ref),
                         raw["counters"])
    if not with_model:
        return state, {}, None
    return state, load_safetensors(blobs[MODEL]), torch.load(io.BytesIO(blobs[OPTIMIZER]), weights_only=True)


def _set_aside(folder: Path) -> None:
    """Rename a damaged checkpoint out of the way (never loaded, never counted as kept)."""
    target, n = folder.with_name(folder.name + ".corrupt"), 1
    while target.exists():
        target, n = folder.with_name(f"{folder.name}.{n}.corrupt"), n + 1
    os.replace(folder, target)


def load_latest(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState | None:
    """Load the newest undamaged checkpoint into ``model`` and ``optimizer``; None when there is none.
    A damaged one is renamed ``<name>.corrupt`` (kept for inspection) and the one before it is used."""
    failures = []
    for found in checkpoints(root):
        try:
            state, tensors, optimizer_state = _read(root, found, with_model=True)
        except DAMAGED as exc:
            failures.append(f"{found.folder.name}: {exc!r}")
            log.error("checkpoint_damaged", checkpoint=str(found.folder), error=repr(exc),
                      action="set aside as .corrupt; resuming from the checkpoint before it")
            _set_aside(found.folder)
            continue
        # A mismatch here is a different model, not damage: it raises and names the tensors.
        model.load_state_dict(tensors, strict=True)
        optimizer.load_state_dict(optimizer_state)  # type: ignore[arg-type]
        if failures:
            _point(root, found.folder)
        return state
    if failures:
        raise TrainerError(f"every checkpoint in {root} is damaged ({'; '.join(failures)}); restore one from a "
                           "backup, or move the folder aside to start again from the initial model")
    return None


def peek_kept(root: Path) -> list[tuple[Path, TrainerState]]:
    """Every undamaged checkpoint's folder and its step, version, counters and ledger, newest
    first, read without a model (tools, tests; safe beside a live trainer, whose writes are all atomic)."""
    kept = []
    for found in checkpoints(root):
        try:
            kept.append((found.folder, _read(root, found, with_model=False)[0]))
        except DAMAGED:  # damaged, or deleted by the trainer's retention while being read
            continue
    return kept


def peek_newest(root: Path) -> tuple[Path, TrainerState] | None:
    """The newest undamaged checkpoint's folder and its state (``peek_kept``)."""
    kept = peek_kept(root)
    return kept[0] if kept else None


def verify_newest(root: Path) -> Path:
    """Read the newest checkpoint back from the disk and check every byte of it (files and
    ledger) against its digests; raises one of ``DAMAGED`` when it does not match.  Its pages are
    dropped from the page cache first where the OS allows, so the check reads what the disk holds,
    not the copy just written from memory."""
    found = checkpoints(root)
    if not found:
        raise CorruptCheckpoint(f"no checkpoint in {root} to verify")
    for path in [*found[0].folder.iterdir(), *(root / "ledger").glob("*")]:
        _drop_cached(path)
    _read(root, found[0], with_model=False)
    return found[0].folder


def _drop_cached(path: Path) -> None:
    if not hasattr(os, "posix_fadvise") or not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # the read that follows reports it
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def peek_latest(root: Path) -> TrainerState | None:
    newest = peek_newest(root)
    return newest[1] if newest is not None else None


def save_ledger(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
                *, keep: int, dropped: Mapping[str, str]) -> bool:
    """Make the ledger entries of dropped groups durable without a new step (groups dropped while
    no batch fills): add them to the newest checkpoint's ledger and to the one before it
    (``dropped.log``), and change nothing else there.  Dropped groups trained nothing, so they fit
    those checkpoints' models whatever steps ran since; writing the trainer's current ledger instead
    would record groups of those steps as trained beside a model without their update.  With no
    checkpoint yet, write a full one of ``state``.  True when two checkpoints now record the entries
    (the newest, and the one a damaged newest falls back to): only then may their groups be acked."""
    found = checkpoints(root)
    if not found:
        save(root, model, optimizer, state, keep=keep)
        return False
    if not dropped:
        return len(found) >= KEEP_AT_LEAST
    if len(found) >= KEEP_AT_LEAST:
        _append_dropped(found[1].folder, dropped)
    newest = found[0]
    if newest.seq == LEGACY:  # the format before ledger files: the whole ledger is in its state.json
        record = json.loads((newest.folder / STATE).read_text())
        for gid, reason in dropped.items():
            record["consumed"].setdefault(gid, reason)
        replace_file(newest.folder / STATE, _json(record))
        return len(found) >= KEEP_AT_LEAST
    store = LedgerStore(root / "ledger")
    ref = _ledger_ref(newest.folder)
    line = store.line(dropped)
    if store.can_extend(ref, len(line)):
        new_ref = store.append(ref, line)
    else:
        entries = store.read(ref)
        for gid, reason in dropped.items():
            entries.setdefault(gid, reason)
        new_ref = store.start_generation(entries)
    replace_file(newest.folder / LEDGER, _json(new_ref.record()))
    if state.consumed.origin == ref:
        state.consumed.saved(new_ref, dropped)
    _retain(root, keep)
    return len(found) >= KEEP_AT_LEAST
