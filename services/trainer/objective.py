"""The trainer's policy-gradient objective: decoupled PPO clip + off-policy correction.

Pure tensor math, no I/O, no model. Three logprobs of each sampled token meet here:

``behaviour_logp``
    recorded by the generator when it sampled the token: possibly several policy
    versions old (asynchronous RL), and computed by different kernels than the trainer's.
``proximal_logp``
    the trainer's own recompute under the weights at the start of this update.
``logp``
    the current policy being optimised (carries the gradient).

The decoupled objective (Hilton et al., "Batch size-invariance for policy optimization";
used for asynchronous RL by AReaL) separates the two jobs a single PPO ratio usually does:

    L_t = - w_t * min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
    r_t = exp(logp - proximal_logp)          trust region, around the proximal policy
    w_t = exp(proximal_logp - behaviour_logp) off-policy correction, detached

Clipping around the *proximal* policy keeps the step size independent of how stale the
data is, while ``w`` corrects for the data having been sampled by another policy (an
older version, or the same version through a different numeric path). Raw ``w`` has
unbounded variance, so it is tamed by one of four corrections (``ObjectiveConfig.correction``):

- ``tis``: truncated IS, ``min(w, is_cap)`` (Yao et al., "Your efficient RL framework
  secretly brings you off-policy RL training"). Biased, bounded variance, never discards.
- ``mis``: masked IS ("icepop"): tokens with ``w`` outside ``[is_low, is_high]`` get no
  gradient at all; inside, ``w``. Large mismatch on a token usually signals a numeric
  fault on the inference side, so such tokens are distrusted instead of down-weighted.
- ``seq_reject``: reject whole sequences whose *geometric-mean* token weight is outside
  ``[seq_low, seq_high]``; surviving tokens are truncated as in ``tis``. The geometric
  mean is length-normalised, so one threshold works for short and long rollouts, where
  the raw product of token weights would reject every long one.
- ``none``: ``w = 1``.

When ``proximal_logp == behaviour_logp`` bit for bit (on-policy, deterministic backend)
``w`` is exactly 1, which every correction leaves unchanged: all four give bit-identical
losses and gradients.

The clip range is asymmetric (DAPO "clip-higher"): a larger ``clip_high`` lets
low-probability tokens with positive advantage grow further, which keeps entropy from
collapsing. Aggregation is token-level by default (DAPO): every token in the batch
weighs the same, so long responses are neither diluted (as under a per-sequence mean) nor
is there a per-sequence length division that Dr. GRPO shows biases towards long wrong
answers. The normaliser is the token (or sequence) count of the *whole* batch, passed by
the caller, so accumulating gradients over micro-batches gives the full-batch gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

Correction = Literal["tis", "mis", "seq_reject", "none"]
Aggregation = Literal["token_mean", "seq_mean"]

POLICY_LOSS_METRICS: tuple[str, ...] = (
    "loss/pg",
    "loss/kl",
    "clip/frac_low",
    "clip/frac_high",
    "is/weight_mean",
    "is/truncated_frac",
    "is/masked_frac",
    "is/seq_rejected_frac",
)
"""Keys of the metrics returned by :func:`policy_loss`, in order."""

# exp(20) ~ 4.9e8: beyond any trust region; clamping the log ratio there only keeps a
# corrupt logprob from producing inf * 0 = NaN in the backward pass.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """Hyper-parameters of :func:`policy_loss`. Immutable; validated on construction."""

    clip_low: float = 0.2
    """PPO lower clip: ratios below ``1 - clip_low`` get no gradient when the advantage
    is negative (stop pushing down a token already pushed down enough). In [0, 1)."""

    clip_high: float = 0.28
    """PPO upper clip: ratios above ``1 + clip_high`` get no gradient when the advantage
    is positive. Larger than ``clip_low`` per DAPO clip-higher, to keep exploration. >= 0."""

    correction: Correction = "tis"
    """Off-policy correction applied to ``w = exp(proximal - behaviour)``: ``"tis"``,
    ``"mis"``, ``"seq_reject"`` or ``"none"`` (see the module docstring)."""

    is_cap: float = 2.0
    """Truncation ``C`` of TIS (also applied inside ``seq_reject``): ``w -> min(w, C)``.
    >= 1, so agreeing logprobs (``w = 1``) pass unchanged."""

    is_low: float = 0.5
    """Lower edge of the MIS band: tokens with ``w < is_low`` are dropped. In (0, 1]."""

    is_high: float = 2.0
    """Upper edge of the MIS band: tokens with ``w > is_high`` are dropped. >= 1."""

    seq_low: float = 0.99
    """Lower edge for ``seq_reject``: a sequence whose geometric-mean token weight is
    below it is dropped. Roughly a bound on the mean per-token log weight
    (``log 0.99 ~ -0.01``). In (0, 1]."""

    seq_high: float = 1.01
    """Upper edge for ``seq_reject``, counterpart of ``seq_low``. >= 1."""

    kl_coef: float = 0.0
    """Weight of a KL penalty to a reference policy (k3 estimator per token, as in GRPO).
    0 disables it; many reasoning-RL recipes (DAPO, Dr. GRPO) drop it. >= 0."""

    aggregation: Aggregation = "token_mean"
    """``"token_mean"``: sum over unmasked tokens / token count of the batch (every token
    weighs the same). ``"seq_mean"``: mean over each sequence's tokens, then over the
    batch's sequences (GRPO's original; every sequence weighs the same)."""

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"ObjectiveConfig: {what}")

        need(0 <= self.clip_low < 1, f"clip_low must be in [0, 1), got {self.clip_low}")
        need(0 <= self.clip_high, f"clip_high must be >= 0, got {self.clip_high}")
        need(
            self.correction in get_args(Correction),
            f"correction must be one of {get_args(Correction)}, got {self.correction!r}",
        )
        need(
            1 <= self.is_cap and math.isfinite(self.is_cap),
            f"is_cap must be finite and >= 1 (w = 1 must pass unchanged), got {self.is_cap}",
        )
        need(
            0 < self.is_low <= 1 <= self.is_high,
            f"need 0 < is_low <= 1 <= is_high, got is_low={self.is_low}, is_high={self.is_high}",
        )
        need(
            0 < self.seq_low <= 1 <= self.seq_high,
            f"need 0 < seq_low <= 1 <= seq_high, got seq_low={self.seq_low}, seq_high={self.seq_high}",
        )
        need(
            0 <= self.kl_coef and math.isfinite(self.kl_coef),
            f"kl_coef must be finite and >= 0, got {self.kl_coef}",
        )
        need(
            self.aggregation in get_args(Aggregation),
            f"aggregation must be one of {get_args(Aggregation)}, got {self.aggregation!r}",
        )


def policy_loss(
    logp: Tensor,
    *,
    proximal_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_index: Tensor,
    n_seqs: int,
    cfg: ObjectiveConfig,
    ref_logp: Tensor | None = None,
    n_tokens_total: int | None = None,
    n_seqs_total: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Loss (scalar, differentiable w.r.t. ``logp``) and metrics of one (micro-)batch.

    All token tensors are flat ``[T]`` (the trainer packs sequences side by side).

    ``logp``: current policy's logprobs of the sampled tokens, requires grad.
    ``proximal_logp``: the policy at the start of this update (trainer recompute).
    ``behaviour_logp``: recorded by the generator. Both are treated as constants.
    ``advantages``: per token, the sequence's advantage broadcast to its tokens.
    ``mask``: ``BoolTensor[T]``, tokens to train on (generated, not prompt or padding).
    ``seq_index``: ``LongTensor[T]`` in ``[0, n_seqs)``, the sequence of each token in
    this call. A sequence must not be split across micro-batches.
    ``ref_logp``: reference-policy logprobs; required when ``cfg.kl_coef > 0``.

    Gradient accumulation: pass ``n_tokens_total`` (unmasked tokens in the whole batch)
    and, for ``seq_mean`` or ``seq_reject``, ``n_seqs_total`` (sequences with at least one
    unmasked token in the whole batch). The losses of the micro-batches then *sum* to the
    full-batch loss, and so do the gradients. Both default to this call's own counts.

    Tokens dropped by a correction contribute zero but stay in the normaliser: the step
    shrinks in proportion to what was distrusted instead of re-amplifying the survivors,
    and the normaliser is known before the step (needed for exact accumulation).

    Metrics follow the same convention: each is this call's share of the batch value
    (token counts over ``n_tokens_total``, sequence counts over ``n_seqs_total``), so
    summing a metric over the micro-batches of a step gives the batch value.

    - ``loss/pg``: the policy-gradient part of the loss.
    - ``loss/kl``: mean k3 KL to the reference (before ``kl_coef``); 0 without ``ref_logp``.
    - ``clip/frac_low`` / ``clip/frac_high``: tokens whose gradient the lower / upper
      clip removed (negative advantage below ``1 - clip_low`` / positive above
      ``1 + clip_high``).
    - ``is/weight_mean``: mean applied correction weight (after truncation / masking).
    - ``is/truncated_frac``: tokens whose weight was cut to ``is_cap``.
    - ``is/masked_frac``: tokens given zero weight by ``mis`` or ``seq_reject``.
    - ``is/seq_rejected_frac``: sequences dropped by ``seq_reject``.
    """
    _check_inputs(logp, proximal_logp, behaviour_logp, advantages, mask, seq_index, n_seqs)
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("cfg.kl_coef > 0 needs ref_logp (reference-policy logprobs)")
    if ref_logp is not None and ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp must have logp's shape {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")

    dtype = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    def masked(t: Tensor) -> Tensor:
        # Replace non-trained positions (padding may hold -inf or garbage) by 0 *before*
        # any arithmetic, so neither the loss nor its backward can see a NaN there.
        return torch.where(mask, t.to(dtype), zero)

    logp_m = masked(logp)
    proximal = masked(proximal_logp.detach())
    behaviour = masked(behaviour_logp.detach())
    adv = masked(advantages.detach())
    seq = torch.where(mask, seq_index, torch.zeros_like(seq_index))
    token = mask.to(dtype)

    seq_tokens = torch.zeros(n_seqs, dtype=dtype, device=logp.device).index_add_(0, seq, token)
    seq_present = seq_tokens > 0
    tokens_norm = _normaliser(n_tokens_total, token.sum(), "n_tokens_total")
    seqs_norm = _normaliser(n_seqs_total, seq_present.sum().to(dtype), "n_seqs_total")

    # Trust region around the proximal policy.
    ratio = torch.exp((logp_m - proximal).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    lower, upper = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    # min(unclipped, clipped) is the pessimistic bound: it removes the incentive to move
    # the ratio outside [lower, upper] in the direction the advantage favours, and keeps
    # the full gradient when the move would undo a previous overshoot.
    surrogate = torch.minimum(ratio * adv, ratio.clamp(lower, upper) * adv)
    clipped_low = mask & (adv < 0) & (ratio < lower)
    clipped_high = mask & (adv > 0) & (ratio > upper)

    # Off-policy correction: constant per token, so it scales the gradient, never its
    # direction.
    corr = _CORRECTIONS[cfg.correction](proximal - behaviour, mask, seq, n_seqs, cfg)
    pg_per_token = -corr.weight * surrogate
    pg = _AGGREGATIONS[cfg.aggregation](pg_per_token, mask, seq, seq_tokens, tokens_norm, seqs_norm)

    if ref_logp is not None:
        # k3 estimate of KL(policy || reference) per token (GRPO): with d = ref - logp,
        # exp(d) - 1 - d >= 0, unbiased when tokens come from the policy. They come from
        # the behaviour policy; the gap is the usual accepted approximation.
        d = (masked(ref_logp.detach()) - logp_m).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl_per_token = torch.expm1(d) - d
        kl = _AGGREGATIONS[cfg.aggregation](kl_per_token, mask, seq, seq_tokens, tokens_norm, seqs_norm)
    else:
        kl = zero

    loss = pg + cfg.kl_coef * kl if cfg.kl_coef > 0 else pg

    with torch.no_grad():
        values = torch.stack(
            [
                pg.detach(),
                kl.detach(),
                clipped_low.sum().to(dtype) / tokens_norm,
                clipped_high.sum().to(dtype) / tokens_norm,
                torch.where(mask, corr.weight, zero).sum() / tokens_norm,
                (corr.truncated & mask).sum().to(dtype) / tokens_norm,
                (corr.dropped & mask).sum().to(dtype) / tokens_norm,
                (corr.rejected_seqs & seq_present).sum().to(dtype) / seqs_norm,
            ]
        )
    # One device sync for all metrics.
    return loss, dict(zip(POLICY_LOSS_METRICS, values.tolist(), strict=True))


class _Corrected(NamedTuple):
    weight: Tensor  # [T] detached weight applied to each token's surrogate
    truncated: Tensor  # [T] bool: weight was cut down to is_cap
    dropped: Tensor  # [T] bool: weight set to 0 by masking or sequence rejection
    rejected_seqs: Tensor  # [n_seqs] bool


def _tis(log_w: Tensor, mask: Tensor, seq: Tensor, n_seqs: int, cfg: ObjectiveConfig) -> _Corrected:
    w = torch.exp(log_w)
    nothing = torch.zeros_like(mask)
    return _Corrected(
        weight=w.clamp_max(cfg.is_cap),
        truncated=w > cfg.is_cap,
        dropped=nothing,
        rejected_seqs=torch.zeros(n_seqs, dtype=torch.bool, device=mask.device),
    )


def _mis(log_w: Tensor, mask: Tensor, seq: Tensor, n_seqs: int, cfg: ObjectiveConfig) -> _Corrected:
    w = torch.exp(log_w)
    outside = (w < cfg.is_low) | (w > cfg.is_high)
    return _Corrected(
        weight=torch.where(outside, torch.zeros_like(w), w),
        truncated=torch.zeros_like(mask),
        dropped=outside,
        rejected_seqs=torch.zeros(n_seqs, dtype=torch.bool, device=mask.device),
    )


def _seq_reject(log_w: Tensor, mask: Tensor, seq: Tensor, n_seqs: int, cfg: ObjectiveConfig) -> _Corrected:
    # Geometric mean of a sequence's token weights = exp(mean log w): averaging in log
    # space makes the test independent of length, and masked tokens (log w zeroed by the
    # caller) neither count nor add.
    counts = torch.zeros(n_seqs, dtype=log_w.dtype, device=log_w.device)
    counts.index_add_(0, seq, mask.to(log_w.dtype))
    sums = torch.zeros(n_seqs, dtype=log_w.dtype, device=log_w.device).index_add_(0, seq, log_w)
    geo_mean = torch.exp(sums / counts.clamp_min(1))
    rejected = (geo_mean < cfg.seq_low) | (geo_mean > cfg.seq_high)
    token_rejected = rejected[seq]
    tis = _tis(log_w, mask, seq, n_seqs, cfg)
    return _Corrected(
        weight=torch.where(token_rejected, torch.zeros_like(tis.weight), tis.weight),
        truncated=tis.truncated & ~token_rejected,
        dropped=token_rejected,
        rejected_seqs=rejected,
    )


def _no_correction(log_w: Tensor, mask: Tensor, seq: Tensor, n_seqs: int, cfg: ObjectiveConfig) -> _Corrected:
    # Still a tensor of ones rather than skipping the multiply, so that "none" and the
    # other corrections at w = 1 run the same arithmetic and agree bit for bit.
    nothing = torch.zeros_like(mask)
    return _Corrected(
        weight=torch.ones_like(log_w),
        truncated=nothing,
        dropped=nothing,
        rejected_seqs=torch.zeros(n_seqs, dtype=torch.bool, device=mask.device),
    )


_CORRECTIONS: dict[str, Callable[[Tensor, Tensor, Tensor, int, ObjectiveConfig], _Corrected]] = {
    "tis": _tis,
    "mis": _mis,
    "seq_reject": _seq_reject,
    "none": _no_correction,
}


def _token_mean(
    per_token: Tensor,
    mask: Tensor,
    seq: Tensor,
    seq_tokens: Tensor,
    tokens_norm: Tensor,
    seqs_norm: Tensor,
) -> Tensor:
    return torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / tokens_norm


def _seq_mean(
    per_token: Tensor,
    mask: Tensor,
    seq: Tensor,
    seq_tokens: Tensor,
    tokens_norm: Tensor,
    seqs_norm: Tensor,
) -> Tensor:
    per_seq = torch.zeros_like(seq_tokens).index_add(0, seq, torch.where(mask, per_token, torch.zeros_like(per_token)))
    return (per_seq / seq_tokens.clamp_min(1)).sum() / seqs_norm


_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean": _seq_mean,
}


def _normaliser(given: int | None, local: Tensor, name: str) -> Tensor:
    if given is None:
        # An all-masked call contributes 0, not 0 / 0.
        return local.clamp_min(1)
    if given <= 0:
        raise ValueError(f"{name} must be a positive count of the whole batch, got {given}")
    return torch.tensor(float(given), dtype=local.dtype, device=local.device)


def _check_inputs(
    logp: Tensor,
    proximal_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_index: Tensor,
    n_seqs: int,
) -> None:
    if logp.dim() != 1:
        raise ValueError(f"logp must be a flat [tokens] tensor, got shape {tuple(logp.shape)}")
    for name, t in (
        ("proximal_logp", proximal_logp),
        ("behaviour_logp", behaviour_logp),
        ("advantages", advantages),
        ("mask", mask),
        ("seq_index", seq_index),
    ):
        if t.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(t.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if seq_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"seq_index must be an int64/int32 tensor, got dtype {seq_index.dtype}")
    if n_seqs < 1:
        raise ValueError(f"n_seqs must be >= 1 (sequences in this call), got {n_seqs}")
    if bool(mask.any()):
        used = seq_index[mask]
        if int(used.min()) < 0 or int(used.max()) >= n_seqs:
            raise ValueError(
                f"seq_index of trained tokens must lie in [0, n_seqs={n_seqs}), got "
                f"[{int(used.min())}, {int(used.max())}]"
            )
