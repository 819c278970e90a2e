"""Group-relative advantages: how much better each rollout did than its siblings.

Pure tensor math, no I/O. A *group* is the ``n`` rollouts sampled for one task; the
advantage of a rollout is its reward minus a baseline computed from the group, optionally
divided by the group's reward spread. The trainer broadcasts each rollout's advantage to
its tokens (``advantages[seq_index]``) before calling the policy loss.

Membership of a group is described by two masks, because the two reasons a rollout is
left out of training have different consequences for its siblings:

``valid`` (trained on)
    The rollout receives an advantage and is trained on. Members outside ``valid`` get an
    advantage of exactly 0.
``baseline_mask`` (counts in the baseline)
    The rollout's reward is trustworthy and enters the group's mean / std / leave-one-out
    baseline. Defaults to ``valid``.

- normal rollout: ``valid`` and ``baseline_mask`` -> trained, counts in the baseline;
- too stale to train on, but its reward is real: only ``baseline_mask`` (an option of the
  caller) -> not trained, yet its reward still sharpens its siblings' baseline;
- verifier error or environment failure: neither -> ignored entirely; its reward may be
  NaN.

``valid`` must be a subset of ``baseline_mask``: a rollout whose reward is not trusted
enough to enter the baseline cannot be trusted enough to be trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass
from torch import Tensor

Baseline = Literal["mean", "leave_one_out"]


@dataclass(frozen=True, kw_only=True, config=ConfigDict(extra="forbid", use_attribute_docstrings=True))
class AdvantageConfig:
    """How :func:`group_advantages` turns a group's rewards into advantages: the
    ``[trainer.advantages]`` table of a run config."""

    normalize_std: bool = True
    """Divide each group's centred rewards by the group's reward std, as GRPO does (each group
    on a comparable scale). False gives Dr. GRPO's unbiased variant (no up-weighting of
    near-unanimous, too easy or too hard, groups)."""

    baseline: Baseline = "mean"
    """The group baseline: ``"mean"`` (GRPO, the group's mean reward) or ``"leave_one_out"``
    (RLOO, the mean of the other members: unbiased, does not shrink advantages by (k-1)/k)."""


def zero_variance_groups(rewards: Tensor, baseline_mask: Tensor | None = None) -> Tensor:
    """Groups whose counted rewards are all equal: ``BoolTensor[G]``.

    Such a group carries no learning signal: every group-relative advantage is zero, so
    its rollouts would only dilute the batch. DAPO's *dynamic sampling* drops them and
    keeps sampling until the batch is full of informative groups; the caller drops and
    counts them. A group with fewer than two counted members is zero-variance too (there
    is nothing to compare against).

    ``rewards``: ``[G, n]``. ``baseline_mask``: ``BoolTensor[G, n]``, members whose reward
    counts (default: all); rewards outside it are ignored and may be NaN.
    """
    mask = _mask_or_all(rewards, baseline_mask, "baseline_mask")
    r = rewards.detach()
    # Fill ignored members with the opposite infinity so they never win max / min.
    hi = torch.where(mask, r, torch.full_like(r, -float("inf"))).amax(dim=1)
    lo = torch.where(mask, r, torch.full_like(r, float("inf"))).amin(dim=1)
    return (hi == lo) | (mask.sum(dim=1) < 2)


def group_advantages(
    rewards: Tensor,
    *,
    valid: Tensor | None = None,
    baseline_mask: Tensor | None = None,
    normalize_std: bool = True,
    baseline: Baseline = "mean",
    eps: float = 1e-6,
) -> Tensor:
    """Advantages ``[G, n]`` of each rollout relative to its group.

    ``rewards``: ``[G, n]``, one row per group (task), one column per sampled rollout.
    ``valid`` / ``baseline_mask``: see the module docstring (defaults: all members, and
    ``baseline_mask = valid``).

    ``baseline="mean"``
        GRPO (DeepSeekMath): the baseline is the group's mean reward. It replaces a
        learned value function, which is expensive and poor for sparse final-answer
        rewards.
    ``baseline="leave_one_out"``
        RLOO: the baseline of member ``i`` is the mean of the *other* counted members. It
        does not depend on ``r_i``, so the estimator stays unbiased, whereas the plain
        mean shrinks every advantage by a factor ``(k-1)/k``.
    ``normalize_std=True``
        Divide by the group's population standard deviation (+ ``eps``), as GRPO does, so
        each group contributes on a comparable scale. Dr. GRPO argues this up-weights
        near-unanimous (too easy / too hard) groups and biases the objective;
        ``normalize_std=False`` gives its unbiased variant. The population std (divisor
        ``k``) is used because it is defined for every group size.

    Zero-variance groups (:func:`zero_variance_groups`) get exactly 0, not a value that
    rounding left near 0 and ``eps`` then inflated. Members outside ``valid`` get 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples_per_group], got shape {tuple(rewards.shape)}")
    if baseline not in _BASELINES:
        raise ValueError(f"baseline must be one of {get_args(Baseline)}, got {baseline!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    valid = _mask_or_all(rewards, valid, "valid")
    baseline_mask = valid if baseline_mask is None else _mask_or_all(rewards, baseline_mask, "baseline_mask")
    if bool((valid & ~baseline_mask).any()):
        raise ValueError(
            "every valid (trained) rollout must also be in baseline_mask: a reward that is "
            "not trusted for the baseline cannot be trained on; fix the masks"
        )

    dtype = torch.promote_types(rewards.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    # Zero the ignored members before any arithmetic: their rewards may be NaN
    # (verifier error) and NaN * 0 would still poison the sums.
    r = torch.where(baseline_mask, rewards.detach().to(dtype), zero)
    if not bool(torch.isfinite(r).all()):
        raise ValueError(
            "a counted reward is NaN or infinite; exclude that rollout from "
            "baseline_mask and valid (it is a verifier failure, not a reward)"
        )

    k = baseline_mask.sum(dim=1, keepdim=True).to(dtype)
    total = r.sum(dim=1, keepdim=True)
    mean = total / k.clamp_min(1)
    sq_dev = torch.where(baseline_mask, (r - mean) ** 2, zero)
    std = (sq_dev.sum(dim=1, keepdim=True) / k.clamp_min(1)).sqrt()

    centred = r - _BASELINES[baseline](r, total, k)
    if normalize_std:
        centred = centred / (std + eps)

    informative = ~zero_variance_groups(rewards, baseline_mask)
    keep = valid & informative[:, None]
    return torch.where(keep, centred, zero)


def _mean_baseline(r: Tensor, total: Tensor, k: Tensor) -> Tensor:
    return total / k.clamp_min(1)


def _leave_one_out_baseline(r: Tensor, total: Tensor, k: Tensor) -> Tensor:
    # Mean of the other counted members: (sum - own) / (k - 1). Only read for counted
    # members of groups with k >= 2 (others are zeroed by the caller), so the clamp only
    # keeps the unused entries finite.
    return (total - r) / (k - 1).clamp_min(1)


_BASELINES: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "mean": _mean_baseline,
    "leave_one_out": _leave_one_out_baseline,
}


def _mask_or_all(rewards: Tensor, mask: Tensor | None, name: str) -> Tensor:
    if mask is None:
        return torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {mask.dtype}")
    if mask.shape != rewards.shape:
        raise ValueError(f"{name} must have the rewards' shape {tuple(rewards.shape)}, got {tuple(mask.shape)}")
    return mask
