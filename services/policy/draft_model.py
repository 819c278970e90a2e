"""A small draft model for speculative decoding, built from the policy it drafts for.

Why it exists: the `model` and `static` drafters (services/policy/spec_tail.py) propose tokens
by sampling a model much cheaper than the policy. The acceptance rule keeps the policy's
distribution exactly whatever the draft proposes, so the draft only has to be cheap and close.
Closeness comes from two places: starting from the policy's own embeddings, first layers,
final norm and output layer (`init="policy"`), and distillation on the policy's samples
(services/policy/distill.py).

Contract: a draft shares the policy's tokenizer and vocabulary (the acceptance rule compares
p and q over the same ids) and its context length (it drafts at the same positions); it is a
Hugging Face causal LM of the policy's architecture with fewer layers, saved and loaded as a
folder like any policy, so weight-broadcast can later carry its versions as a second model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from rlbus.services.policy.errors import PolicyError
from rlbus.services.policy.load import load_policy

DraftInit = Literal["policy", "fresh"]


class DraftModelError(PolicyError):
    """A draft model cannot be built or loaded for this policy."""


def build_draft(policy: PreTrainedModel, *, layers: int = 1, init: DraftInit = "policy", seed: int = 0) -> PreTrainedModel:
    """A draft of `policy`'s architecture and width with `layers` decoder layers.

    init="policy": embeddings, the first `layers` decoder layers, the final norm and the output
    layer are copies of the policy's (the draft then starts as the policy with its later layers
    skipped); "fresh": random weights under `seed`. "policy" starts far closer. Measured on the
    tests' tiny addition policy (4 layers; acceptance under the real rule, T = 1, k = 4, 12 held-out
    prompts x 3 seeds): answers with <eos>: 1 layer 0.06-0.10 from the policy vs 0.005 fresh, 2 layers
    0.28-0.35 vs 0.007; <eos> off, 24 tokens: 1 layer 0.05-0.07, 2 layers 0.40-0.48 from the policy
    (docs/measurements/draft-model-cpu2-2026-12-06.md).
    """
    total = getattr(policy.config, "num_hidden_layers", None)
    if total is None:
        raise DraftModelError(f"{type(policy).__name__} has no config.num_hidden_layers: the draft copies the "
                              "policy's config with fewer layers, so the policy must be a decoder-only causal LM")
    if not 1 <= layers <= total:
        raise DraftModelError(f"layers={layers}: use 1..{total} (the policy has {total}); fewer layers draft faster")
    if init not in ("policy", "fresh"):
        raise DraftModelError(f"init={init!r}: use 'policy' (copy its first layers) or 'fresh' (random)")
    config = policy.config.__class__.from_dict(policy.config.to_dict())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:layers]
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(config, dtype=policy.dtype)
    if init == "policy":
        # Same architecture, so the names of the kept layers are the policy's; layers past
        # `layers` simply have no counterpart in the draft.
        source = policy.state_dict()
        with torch.no_grad():
            for name, tensor in draft.state_dict().items():
                tensor.copy_(source[name])
    draft.generation_config = policy.generation_config
    return draft.eval()


def save_draft(draft: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Write the draft as a Hugging Face folder (weights, config and the policy's tokenizer)."""
    out = Path(path)
    draft.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def check_draft(draft: PreTrainedModel, policy: PreTrainedModel, where: str = "the draft") -> None:
    """Raise `DraftModelError` unless `draft` can draft for `policy`: same vocabulary, same context."""
    for key, what in (("vocab_size", "vocabulary size"), ("max_position_embeddings", "context length")):
        ours, theirs = getattr(draft.config, key, None), getattr(policy.config, key, None)
        if ours != theirs:
            raise DraftModelError(
                f"{where} has {what} {ours}, the policy {theirs}: a draft must share the policy's tokenizer and "
                "context (build one with rlbus.services.policy.draft_model.build_draft from this policy)")


def load_draft(path: str | Path, policy: PreTrainedModel) -> PreTrainedModel:
    """The draft saved at `path`, checked against `policy` (vocabulary, context, dtype follows the policy)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise DraftModelError(
            f"draft_model_path {str(folder)!r} is not a model folder (no config.json): build one with "
            "rlbus.services.policy.draft_model.build_draft and save_draft, or set drafter = \"group\" / \"off\"")
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(policy.dtype, "float32")
    draft, _ = load_policy(folder, dtype=dtype, device=str(next(policy.parameters()).device))  # type: ignore[arg-type]
    check_draft(draft, policy, where=f"the draft at {folder}")
    return draft
