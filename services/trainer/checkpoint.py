"""Durable checkpoints: model, optimiser, step, version, every consumed group id and why.

Written to ``<dir>/step-<N>.tmp`` with every file fsynced, then renamed to ``step-<N>`` and the
``latest`` pointer replaced atomically: a crash at any point leaves the previous checkpoint
intact.  The trainer acks the messages a step used only after this returns, so a restarted
trainer resumes here and recognises redelivered groups as already consumed.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    consumed: dict[str, str] = field(default_factory=dict)  # group id -> "train" | drop reason
    counters: dict[str, float] = field(default_factory=dict)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: object) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _state_record(state: TrainerState) -> dict[str, object]:
    return {"step": state.step, "version": state.version, "consumed": state.consumed, "counters": state.counters}


def save(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState, *, keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:08d}"
    tmp = root / f"step-{state.step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # Clone tensors: tied or shared storages cannot be saved by safetensors as aliases.
    save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
    # Optimiser state is tensors + numbers only, so it loads back with weights_only=True.
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    for f in ("model.safetensors", "optimizer.pt"):
        with open(tmp / f, "rb+") as fh:
            os.fsync(fh.fileno())
    _write_json(tmp / "state.json", _state_record(state))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer_tmp = root / "latest.tmp"
    _write_json(pointer_tmp, {"checkpoint": final.name})
    os.replace(pointer_tmp, root / "latest")
    _fsync_dir(root)
    for old in sorted(p for p in root.glob("step-*") if not p.name.endswith(".tmp"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState | None:
    pointer = root / "latest"
    if not pointer.exists():
        return None
    folder = root / json.loads(pointer.read_text())["checkpoint"]
    tensors = load_file(str(folder / "model.safetensors"))
    model.load_state_dict(tensors, strict=True)
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    raw = json.loads((folder / "state.json").read_text())
    return TrainerState(step=raw["step"], version=raw["version"], consumed=raw["consumed"], counters=raw["counters"])


def save_ledger(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
                *, keep: int, dropped: dict[str, str]) -> None:
    """Make the ledger entries of dropped groups durable without a new step (groups dropped while
    no batch fills): add them to the latest checkpoint's state.json and change nothing else there.
    Dropped groups trained nothing, so they fit that checkpoint's model whatever steps ran since;
    writing the trainer's current ledger instead would record groups of those steps as trained
    beside a model without their update.  With no checkpoint yet, write a full one of ``state``."""
    pointer = root / "latest"
    if not pointer.exists():
        save(root, model, optimizer, state, keep=keep)
        return
    folder = root / json.loads(pointer.read_text())["checkpoint"]
    record = json.loads((folder / "state.json").read_text())
    for gid, reason in dropped.items():
        record["consumed"].setdefault(gid, reason)
    tmp = folder / "state.json.tmp"
    _write_json(tmp, record)
    os.replace(tmp, folder / "state.json")
    _fsync_dir(folder)
