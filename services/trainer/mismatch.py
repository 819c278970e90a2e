"""Training–inference consistency: how far the trainer's logprobs are from the sampler's.

Pure tensor math, no I/O; the trainer calls :func:`mismatch_metrics` every step (design
invariant 3). The generator samples with its own kernels, precision and batching, so the
logprob it records for a token (the *behaviour* logprob) differs from what the trainer
recomputes for the same weights. Yao et al. ("Your efficient RL framework secretly brings
you off-policy RL training") show this gap alone can make nominally on-policy training
off-policy and unstable; these numbers make it visible, and the importance-sampling
corrections in ``objective.py`` act on the same weights.

All statistics are over the unmasked tokens and computed in float64, so they are exact
for the degenerate case (identical logprobs: k3 0, perplexity ratio 1, ESS 1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MISMATCH_METRICS: tuple[str, ...] = (
    "mismatch/abs_diff_mean",
    "mismatch/abs_diff_max",
    "mismatch/k3_kl",
    "mismatch/ppl_ratio",
    "mismatch/ess",
    "mismatch/truncated_frac",
    "mismatch/masked_frac",
    "mismatch/seq_ess",
)
"""Keys of :func:`mismatch_metrics`, in order."""


def mismatch_metrics(
    trainer_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    seq_index: Tensor,
    *,
    is_low: float,
    is_high: float,
    is_cap: float | None = None,
) -> dict[str, float]:
    """Mismatch statistics between trainer and behaviour logprobs of the same tokens.

    ``trainer_logp``, ``behaviour_logp``: ``[T]`` logprobs of the sampled tokens under the
    trainer's recompute and under the generator. ``mask``: ``BoolTensor[T]``, the tokens
    to measure (generated tokens, not prompt or padding). ``seq_index``: ``LongTensor[T]``,
    the sequence each token belongs to (any integer labels). ``is_low`` / ``is_high``: the
    masked-IS band; ``is_cap``: the truncation threshold (defaults to ``is_high``).

    With the token importance weight ``w = π_trainer / π_behaviour = exp(log r)``,
    ``log r = trainer_logp - behaviour_logp``:

    - ``mismatch/abs_diff_mean``, ``mismatch/abs_diff_max``: mean and max of ``|log r|``.
    - ``mismatch/k3_kl``: KL(behaviour || trainer) by Schulman's k3 estimator,
      mean of ``w - 1 - log r``. The tokens were sampled from the behaviour policy, so this
      is the unbiased, always non-negative, low-variance estimator for that direction.
    - ``mismatch/ppl_ratio``: trainer perplexity / behaviour perplexity over the same
      tokens, ``exp(-mean log r)``; above 1 means the trainer finds the samples less
      likely than the sampler did.
    - ``mismatch/ess``: normalised effective sample size ``(Σw)² / (N Σw²)`` in (0, 1]:
      the fraction of the batch that still counts after importance weighting.
    - ``mismatch/truncated_frac``: fraction of tokens with ``w > is_cap`` (what truncated
      IS would clip).
    - ``mismatch/masked_frac``: fraction with ``w`` outside ``[is_low, is_high]`` (what
      masked IS would drop).
    - ``mismatch/seq_ess``: the same ESS over sequences, with the sequence weight the
      product of its token weights (the true sequence-level ratio). It collapses much
      faster than the token ESS on long sequences: that is the signal.

    Raises ``ValueError`` on mismatched shapes or dtypes, an empty mask, a bad band, or a
    NaN / infinite logprob on a measured token.
    """
    _check(trainer_logp, behaviour_logp, mask, seq_index, is_low, is_high, is_cap)
    cap = is_high if is_cap is None else is_cap
    with torch.no_grad():
        log_r = _log_ratios(trainer_logp, behaviour_logp, mask)
        w = torch.exp(log_r)
        abs_diff = log_r.abs()
        # k3 = (w - 1) - log w >= 0 for every token; expm1 keeps it accurate for the tiny
        # |log r| a good backend produces, and the clamp absorbs a last-ulp rounding
        # below 0.
        k3 = (torch.expm1(log_r) - log_r).clamp_min(0.0)
        # ppl_trainer / ppl_behaviour = exp(-mean t) / exp(-mean b) = exp(-mean(t - b)).
        ppl_ratio = torch.exp(-log_r.mean())
        values = torch.stack(
            [
                # A mean of equal values can round one ulp above them: never report mean > max.
                torch.minimum(abs_diff.mean(), abs_diff.max()),
                abs_diff.max(),
                k3.mean(),
                ppl_ratio,
                _normalised_ess(log_r),
                (w > cap).to(torch.float64).mean(),
                ((w < is_low) | (w > is_high)).to(torch.float64).mean(),
                _normalised_ess(_sequence_log_weights(log_r, seq_index, mask)),
            ]
        )
    # One device sync for all metrics.
    return dict(zip(MISMATCH_METRICS, values.tolist(), strict=True))


def _log_ratios(trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> Tensor:
    """``log r = trainer - behaviour`` of the measured tokens, in float64."""
    trainer = trainer_logp.detach()[mask].to(torch.float64)
    behaviour = behaviour_logp.detach()[mask].to(torch.float64)
    if not bool(torch.isfinite(trainer).all() & torch.isfinite(behaviour).all()):
        raise ValueError(
            "a measured token has a NaN or infinite logprob; the rollout or the "
            "trainer's recompute is corrupt and must not be trained on"
        )
    return trainer - behaviour


def _sequence_log_weights(log_r: Tensor, seq_index: Tensor, mask: Tensor) -> Tensor:
    """log of each sequence's weight ``Π_t w_t``, summed in log space so a long sequence does
    not overflow before the ESS rescales it."""
    _, seq = torch.unique(seq_index[mask], return_inverse=True)
    n_seqs = int(seq.max().item()) + 1
    seq_log_w = torch.zeros(n_seqs, dtype=torch.float64, device=log_r.device)
    seq_log_w.index_add_(0, seq, log_r)
    return seq_log_w


def _normalised_ess(log_w: Tensor) -> Tensor:
    """``(Σw)² / (N Σw²)`` from log weights, in (0, 1].

    The ratio is invariant to scaling all weights, so shifting by the max log weight
    changes nothing mathematically but keeps ``exp`` finite: the largest weight becomes
    exactly 1, hence ``Σw >= 1`` and the ESS stays above 0 even when the others underflow.
    Cauchy–Schwarz bounds it by 1; the clamp removes a last-ulp excess.
    """
    w = torch.exp(log_w - log_w.max())
    ess = w.sum() ** 2 / (w.numel() * (w * w).sum())
    return ess.clamp_max(1.0)


def _check(
    trainer_logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    seq_index: Tensor,
    is_low: float,
    is_high: float,
    is_cap: float | None,
) -> None:
    if trainer_logp.dim() != 1:
        raise ValueError(f"logprobs must be flat [tokens] tensors, got shape {tuple(trainer_logp.shape)}")
    for name, t in (("behaviour_logp", behaviour_logp), ("mask", mask), ("seq_index", seq_index)):
        if t.shape != trainer_logp.shape:
            raise ValueError(f"{name} must have trainer_logp's shape {tuple(trainer_logp.shape)}, got {tuple(t.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if seq_index.dtype.is_floating_point or seq_index.dtype == torch.bool:
        raise ValueError(f"seq_index must be an integer tensor, got dtype {seq_index.dtype}")
    if not bool(mask.any()):
        raise ValueError("mismatch_metrics needs at least one unmasked token; the mask is empty")
    if not 0 < is_low <= 1 <= is_high:
        raise ValueError(
            f"need 0 < is_low <= 1 <= is_high so that agreeing logprobs (w = 1) are inside "
            f"the band, got is_low={is_low}, is_high={is_high}"
        )
    if is_cap is not None and not (is_cap >= 1 and math.isfinite(is_cap)):
        raise ValueError(f"is_cap must be a finite number >= 1, got {is_cap}")
