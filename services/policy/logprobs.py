"""Per-token log-probs of completions under the current weights (full-forward recompute).

Why it exists: the trainer needs the policy's log-probs of the tokens the generator sampled
(with gradients), and the deterministic generator needs the very same numbers (without). One
function serves both, so "trainer logprob" and "recomputed behaviour logprob" cannot drift.

Two modes:
- default: one right-padded batch, one forward. Fast; the values depend (at the 1e-7 level)
  on what else is in the batch, because kernel shapes do.
- `deterministic=True`, the batch-invariant path (`services/policy/exact.py`,
  `shared_prompt_logprobs`): each distinct prompt, then each completion against its prompt's KV,
  is computed in a fixed (batch size, bucketed length) shape that depends only on its own
  lengths, with the padding masked and the attention kernel pinned, in batches. For given
  weights and tokens the result is bit-identical whoever calls it and whatever it is batched
  with, with or without autograd, as long as both sides run the same device and library build
  (`bench/batch_invariance.py`; docs/measurements/batch-invariance-cpu2-2026-12-05.md). Batches,
  not one forward per sequence, because the per-sequence forwards cost several times more there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlbus.services.policy.exact import deterministic_shapes, shared_prompt_logprobs
from rlbus.services.policy.sampling import SamplingParams, processed_logprobs
from rlbus.services.policy.sequences import LogprobInputError, PromptCompletion, check_sequences

# Importers take these from here, where they were first defined.
__all__ = ["LogprobInputError", "PromptCompletion", "check_sequences", "completion_logprobs", "shared_prefix_logprobs"]

def completion_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[PromptCompletion],
    params: SamplingParams,
    *,
    deterministic: bool = False,
    grad: bool = False,
) -> list[torch.Tensor]:
    """Log-prob of each completion token under `processed_logprobs(params)`, one tensor per pair.

    Each result is float32 with shape (len(completion),); it carries a graph when `grad` is
    True. The model's train/eval mode is the caller's choice (the tiny Qwen2 has no dropout).
    """
    config = getattr(model, "config", None)
    check_sequences(sequences, getattr(config, "max_position_embeddings", None), getattr(config, "vocab_size", None))
    if not sequences:
        return []
    if deterministic:
        return shared_prompt_logprobs(model, sequences, params, deterministic_shapes(model), grad=grad)
    with torch.set_grad_enabled(grad):
        return _batched(model, sequences, params)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _batched(
    model: torch.nn.Module, sequences: Sequence[PromptCompletion], params: SamplingParams
) -> list[torch.Tensor]:
    device = _device(model)
    lengths = [len(p) + len(c) for p, c in sequences]
    width = max(lengths)
    # Right padding needs no attention mask: under causal attention a real token only sees
    # earlier positions, which are all real, so the pads after it cannot change its logits.
    # Leaving the mask out keeps SDPA on its causal fast path. Pad id 0 is any valid id.
    ids = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    for row, (prompt, completion) in enumerate(sequences):
        ids[row, : lengths[row]] = torch.tensor([*prompt, *completion], dtype=torch.long)
    # Only positions from the earliest "last prompt token" on are needed (big-vocab memory).
    first = min(len(p) for p, _ in sequences) - 1
    keep = width - first
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
    logprobs = processed_logprobs(logits, params.temperature, params.top_p)
    # Position j predicts token j+1; the last kept position predicts nothing (target 0).
    targets = torch.zeros((len(sequences), keep), dtype=torch.long, device=device)
    targets[:, :-1] = ids[:, first + 1 :]
    token_logprobs = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    out: list[torch.Tensor] = []
    for row, (prompt, completion) in enumerate(sequences):
        start = len(prompt) - 1 - first
        out.append(token_logprobs[row, start : start + len(completion)])
    return out


def shared_prefix_logprobs(
    model: torch.nn.Module,
    groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
    params: SamplingParams,
    *,
    grad: bool = False,
) -> list[list[torch.Tensor]]:
    """Like `completion_logprobs`, for groups of completions that share one prompt.

    The prompt of each group is forwarded once and its KV cache gathered to every completion
    of the group (gradients flow back through the gather), so a group of n samples costs one
    prompt forward instead of n. For GRPO batches (n samples per prompt) this about halves the
    trainer's forward/backward work when prompts are as long as completions. Values equal the
    full recompute up to float rounding (kernel shapes differ); the deterministic path stays
    `completion_logprobs(..., deterministic=True)`.
    """
    config = getattr(model, "config", None)
    flat = [(p, c) for p, cs in groups for c in cs]
    check_sequences(flat, getattr(config, "max_position_embeddings", None), getattr(config, "vocab_size", None))
    if not flat:
        return [[] for _ in groups]
    device = _device(model)
    prompt_lens = torch.tensor([len(p) for p, _ in groups], dtype=torch.long)
    width = int(prompt_lens.max())
    padded = bool((prompt_lens != width).any())
    prompt_ids = torch.zeros((len(groups), width), dtype=torch.long)
    for g, (p, _) in enumerate(groups):
        prompt_ids[g, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
    owner = torch.tensor([g for g, (_, cs) in enumerate(groups) for _ in cs], dtype=torch.long)
    comp_lens = [len(c) for _, c in flat]
    comp_width = max(max(comp_lens), 1)
    comp_ids = torch.zeros((len(flat), comp_width), dtype=torch.long)
    for row, (_, c) in enumerate(flat):
        comp_ids[row, : len(c)] = torch.tensor(list(c), dtype=torch.long)
    prompt_mask = positions = None
    if padded:
        # Left padding keeps every prompt's last token in the last column.
        prompt_mask = (torch.arange(width) >= (width - prompt_lens)[:, None]).long()
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    from transformers import DynamicCache

    with torch.set_grad_enabled(grad):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompt_ids.to(device), attention_mask=None if prompt_mask is None else prompt_mask.to(device),
                    position_ids=None if positions is None else positions.to(device), past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_select_indices(owner.to(device))
        first_logits = out.logits[:, -1][owner.to(device)]
        comp_mask = comp_pos = None
        if padded:
            # Completions are right-padded: pads come after every real token, so causal attention
            # needs the mask only for the left-padded prompt part.
            comp_mask = torch.cat([prompt_mask[owner], torch.ones((len(flat), comp_width), dtype=torch.long)], 1)
            comp_pos = prompt_lens[owner][:, None] + torch.arange(comp_width)[None, :]
        else:
            comp_pos = torch.arange(width, width + comp_width)[None, :].expand(len(flat), -1)
        logits = model(input_ids=comp_ids.to(device), attention_mask=None if comp_mask is None else comp_mask.to(device),
                       position_ids=comp_pos.to(device), past_key_values=cache, use_cache=True).logits
        # Token 0 of each completion is predicted by the prompt's last position, token j by
        # completion position j-1.
        all_logits = torch.cat([first_logits[:, None], logits[:, :-1]], dim=1)
        logprobs = processed_logprobs(all_logits, params.temperature, params.top_p)
        token_lp = logprobs.gather(-1, comp_ids.to(device).unsqueeze(-1)).squeeze(-1)
    result: list[list[torch.Tensor]] = []
    row = 0
    for _, cs in groups:
        result.append([token_lp[row + k, : len(c)] for k, c in enumerate(cs)])
        row += len(cs)
    return result
