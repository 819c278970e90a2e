"""Whether a scored group can be trained on at all, judged when the trainer takes it in.

The schemas guarantee a group's shapes (``prompt_len`` within the tokens, one loss-mask entry and
one behaviour logprob per completion token, finite rewards, a valid version list); they cannot
know the model the trainer holds.  A group that is well-typed but cannot be trained on (a reward
that overflows the float32 batch, a token id outside the vocabulary, more tokens than the model's
context, a NaN behaviour logprob) would otherwise be kept for a batch and fail inside the step:
the trainer would die and, on its redelivery, die again.  Judged here, such a group is refused
alone (``Assembler.offer``: fate ``invalid`` in the ledger, dead-lettered with the reason once a
checkpoint covers it) and the groups around it train.

Every rollout of the group is judged, trained or not: a group carrying one impossible rollout is
not what any generator of this run produced, and refusing it whole keeps the rule simple.
Pure, no I/O; numpy over each rollout's arrays, a handful of passes per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlbus.schemas import ScoredGroup, ScoredRollout

# Rewards of real verifiers are of order 1 (0/1 correctness, a few shaped components).  The
# trainer packs them into float32 and normalises each group by its mean and standard deviation:
# squares of |r| <= 1e6 stay near 1e12, far from float32's overflow at ~3.4e38 even summed over
# the largest group (1024 rollouts), while 1e308 does not even convert.  A reward beyond the bound
# is a verifier fault (or a forged group), and one such reward would swamp its group's baseline.
MAX_ABS_REWARD = 1e6


@dataclass(frozen=True)
class InputLimits:
    """What the trained model can score: token ids in ``[0, vocab_size)`` and at most
    ``max_positions`` tokens per rollout.  None = not known (no model): not judged."""

    vocab_size: int | None = None
    max_positions: int | None = None

    @classmethod
    def of_model(cls, model: Any) -> InputLimits:
        """The limits ``rlbus.services.policy.logprobs`` enforces for ``model``: its config's
        ``vocab_size`` and ``max_position_embeddings``."""
        config = getattr(model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        positions = getattr(config, "max_position_embeddings", None)
        return cls(vocab_size=int(vocab) if vocab is not None else None,
                   max_positions=int(positions) if positions is not None else None)


def judge_group(group: ScoredGroup, limits: InputLimits) -> str:
    """Why ``group`` cannot be trained on, naming the rollout, the field, the value and the limit;
    empty when it can."""
    for s in group.scored:
        problem = _rollout_problem(s, limits)
        if problem:
            return f"rollout {s.rollout.rollout_id!r} of group {group.task.task_id!r}: {problem}"
    return ""


def _rollout_problem(s: ScoredRollout, limits: InputLimits) -> str:
    r = s.rollout
    if not (math.isfinite(s.reward) and abs(s.reward) <= MAX_ABS_REWARD):
        return (f"reward = {s.reward:g} is outside [-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}]: "
                "rewards are of order 1; fix the verifier's scale or the producer of this group")
    ids: np.ndarray = np.asarray(r.token_ids)
    if len(ids):
        outside = ids < 0
        if limits.vocab_size is not None:
            outside |= ids >= limits.vocab_size
        bad = np.flatnonzero(outside)
        if len(bad):
            k = int(bad[0])
            vocab = f"[0, {limits.vocab_size})" if limits.vocab_size is not None else "[0, vocab_size)"
            return (f"token_ids[{k}] = {int(ids[k])} is outside the model's vocabulary {vocab}: "
                    "was it produced by a different tokenizer or model?")
    if limits.max_positions is not None and len(ids) > limits.max_positions:
        return (f"{len(ids)} tokens (prompt {r.prompt_len} + completion {r.completion_len}) exceed the model's "
                f"max_position_embeddings={limits.max_positions}: lower the task's max_new_tokens or shorten "
                "the prompt")
    lp: np.ndarray = np.asarray(r.behaviour_logprobs)
    nonfinite = np.flatnonzero(~np.isfinite(lp))
    if len(nonfinite):
        # A NaN here would make the whole batch's loss NaN (the step is then skipped): every good
        # group of the batch would be consumed without training.
        k = int(nonfinite[0])
        return (f"behaviour_logprobs[{k}] = {float(lp[k])} is not finite: the generator's logprobs "
                "must be finite (0 where loss_mask is 0)")
    return ""
