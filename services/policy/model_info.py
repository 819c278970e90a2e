"""The file in which a model folder that rlbus built describes itself (seed, warm-start steps,
held-out accuracy, the task it was warm-started on, or the pretrained source it was converted from),
beside its weights; and how every such folder is put in place.

Kept apart from model_init.py (which imports torch) so that `rlbus up` can name it with cheap imports.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MODEL_INFO_FILE = "rlbus_model.json"


def make_readable(folder: str | Path) -> None:
    """Every file of a model folder world-readable (directories searchable).  safetensors writes its
    file with mode 0600; services that run as another user than the one who built the folder
    (systemd's rlbus user, a container's) would then fail on a file that exists."""
    root = Path(folder)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    root.chmod(0o755)


def install_folder(staging: str | Path, out: str | Path) -> None:
    """Move a fully written model folder into place: readable by every user, replacing ``out``.  A
    crash before this leaves only the staging folder, never a half-written model where a service
    would load it."""
    staging, out = Path(staging), Path(out)
    make_readable(staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
