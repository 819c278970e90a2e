"""``rlbus init-model``: build the small warm-started policy (deterministic under the seed), or fetch
and convert a pretrained one (``--from``)."""

from __future__ import annotations

import json
from pathlib import Path


def init_model_cmd(out: str, *, seed: int, target: float, overwrite: bool = False, task: str = "addition") -> int:
    import sys

    import torch

    from rlbus.services.policy.calc_init import init_calculator_model
    from rlbus.services.policy.model_init import ModelInitError, init_model

    torch.set_num_threads(1)
    build = init_calculator_model if task == "calculator" else init_model
    try:
        info = build(Path(out), seed=seed, warm_start_target=target, overwrite=overwrite)
    except ModelInitError as exc:
        print(f"rlbus init-model: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


def init_draft_cmd(policy: str, out: str, *, layers: int, overwrite: bool = False) -> int:
    """``rlbus init-draft``: a draft model for drafter "model" / "static": the policy's first
    ``layers`` decoder layers, embeddings, norm and head (services/policy/draft_model.py)."""
    import sys

    import torch

    from rlbus.services.policy.draft_model import DraftModelError, build_draft, save_draft
    from rlbus.services.policy.load import load_policy

    torch.set_num_threads(1)
    if (Path(out) / "config.json").exists() and not overwrite:
        print(f"rlbus init-draft: {out} already holds a model: pass --overwrite to replace it", file=sys.stderr)
        return 2
    try:
        model, tokenizer = load_policy(policy)
        draft = build_draft(model, layers=layers)
    except (DraftModelError, OSError, ValueError) as exc:
        print(f"rlbus init-draft: {exc}", file=sys.stderr)
        return 2
    save_draft(draft, tokenizer, out)
    print(json.dumps({"draft": out, "policy": policy, "layers": layers,
                      "policy_layers": model.config.num_hidden_layers}))
    return 0


def fetch_model_cmd(name: str, out: str | None, *, dtype: str, overwrite: bool = False) -> int:
    """``rlbus init-model --from NAME``: services/policy/pretrained.py."""
    import sys

    from rlbus.services.policy.pretrained import PretrainedError, default_folder, fetch_pretrained

    try:
        folder = Path(out) if out else default_folder(name)
        info = fetch_pretrained(name, folder, dtype=dtype, overwrite=overwrite,  # type: ignore[arg-type]
                                log=lambda line: print(line, file=sys.stderr, flush=True))
    except PretrainedError as exc:
        print(f"rlbus init-model: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"model": str(folder), **info}))
    return 0
