"""Warm-started policies shipped with rlbus: the same starting weights on every machine.

Why they exist: the warm start (`model_init.py`) is deterministic under its seed for one set of
library builds only. Another torch or transformers build trains other weights from the same seed,
and how fast RL then learns depends a lot on them (README, Known limitations). So `rlbus up` and
the tests copy the shipped folder whose task, seed and target match what they would build, and the
figures in the README hold on any machine; `rlbus init-model` still builds one from scratch.

Each folder is a Hugging Face model folder plus `rlbus_model.json`, which records how it was built
and the sha256 of its weights: a damaged or half-fetched file is refused, never trained from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from services.policy.errors import PolicyError

# Import-light on purpose (no torch): `rlbus up` reads it before any service starts.
MODEL_INFO_FILE = "rlbus_model.json"  # how a model folder was built (model_init.py writes it)
SHIPPED_DIR = Path(__file__).with_name("shipped")
WEIGHTS_FILE = "model.safetensors"


class ShippedModelError(PolicyError):
    """A shipped warm start is missing a file or its weights are not the recorded ones."""


def _info(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / MODEL_INFO_FILE).read_text()))


def find_shipped(task: str, seed: int, target: float, *, root: Path = SHIPPED_DIR) -> Path | None:
    """The shipped folder built for `task` with `seed` up to `target`, or None (then build one)."""
    for folder in sorted(p for p in root.glob("*") if (p / MODEL_INFO_FILE).exists()):
        info = _info(folder)
        if (info.get("task", "addition"), info["seed"], info["warm_start_target"]) == (task, seed, target):
            return folder
    return None


def weights_digest(folder: Path) -> str:
    h = hashlib.sha256()
    with open(folder / WEIGHTS_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def copy_shipped(source: Path, out: Path) -> dict[str, Any]:
    """Copy the shipped folder `source` to `out` after checking its weights; returns its record.

    Written next to `out` and renamed into place, like a fresh build, so a crash never leaves a
    half-copied model where a service would load it."""
    info = _info(source)
    if not (source / WEIGHTS_FILE).exists():
        raise ShippedModelError(f"{source / WEIGHTS_FILE} is missing: restore it (git checkout -- {source}) "
                                f"or build the policy with `rlbus init-model --out {out}`")
    digest = weights_digest(source)
    if digest != info["sha256"]:
        raise ShippedModelError(
            f"{source / WEIGHTS_FILE} has sha256 {digest[:12]}…, not the recorded {str(info['sha256'])[:12]}…: the "
            f"file is damaged or not fully fetched; restore it (git checkout -- {source}) or build the policy with "
            f"`rlbus init-model --out {out}`")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return info
