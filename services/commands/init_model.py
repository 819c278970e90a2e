"""``rlbus init-model``: build the small warm-started policy (deterministic under the seed)."""

from __future__ import annotations

import json
from pathlib import Path


def init_model_cmd(out: str, *, seed: int, target: float) -> int:
    import torch

    from services.policy.model_init import init_model

    torch.set_num_threads(1)
    info = init_model(Path(out), seed=seed, warm_start_target=target)
    print(json.dumps(info))
    return 0
