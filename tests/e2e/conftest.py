"""End-to-end fixtures: the warm-started tiny policy, built once per session (cached locally).

The model is deterministic under its seed, so a cached folder is the same model a fresh build
gives; CI (a fresh clone) builds it once per run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CACHE = Path(__file__).resolve().parents[1] / ".cache"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    out = CACHE / "tiny-addition-seed0"
    if not (out / "config.json").exists():
        import torch

        from services.policy.model_init import init_model

        torch.set_num_threads(1)
        init_model(out, seed=0, overwrite=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return out
