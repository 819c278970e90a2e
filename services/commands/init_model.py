"""``rlbus init-model``: build the small warm-started policy (deterministic under the seed)."""

from __future__ import annotations

import json
from pathlib import Path


def init_model_cmd(out: str, *, seed: int, target: float, overwrite: bool = False, task: str = "addition") -> int:
    import sys

    import torch

    from services.policy.calc_init import init_calculator_model
    from services.policy.model_init import ModelInitError, init_model

    torch.set_num_threads(1)
    build = init_calculator_model if task == "calculator" else init_model
    try:
        info = build(Path(out), seed=seed, warm_start_target=target, overwrite=overwrite)
    except ModelInitError as exc:
        print(f"rlbus init-model: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0
