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

from collections.abc import Callable
from typing import Annotated, Literal, NamedTuple

import torch
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass
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


@dataclass(frozen=True, kw_only=True, config=ConfigDict(extra="forbid", use_attribute_docstrings=True))
class ObjectiveConfig:
    """Hyper-parameters of :func:`policy_loss`: the ``[trainer.objective]`` table of a run config.

    Immutable, validated on construction; each bound below is what this module needs to be
    well defined, and the attribute docstrings are the field descriptions a config error quotes.
    The weight ``w = exp(proximal - behaviour)`` of a token is 1 exactly when trainer and
    generator agree, so every band must contain 1: agreeing logprobs must pass unchanged
    (that is what makes the four corrections bit-identical on-policy)."""

    clip_low: Annotated[float, Field(ge=0, lt=1)] = 0.2
    """PPO lower clip, in [0, 1): ratios below ``1 - clip_low`` get no gradient when the
    advantage is negative (stop pushing down a token already pushed down enough). Below 1 so
    that the lower edge of the trust region stays a positive ratio."""

    clip_high: Annotated[float, Field(ge=0)] = 0.28
    """PPO upper clip, >= 0: ratios above ``1 + clip_high`` get no gradient when the advantage
    is positive. Larger than ``clip_low`` per DAPO clip-higher, to keep exploration; >= 0 so
    that an unchanged token (ratio 1) is never clipped."""

    correction: Correction = "tis"
    """Off-policy correction applied to ``w = exp(proximal - behaviour)``: ``"tis"``
    (truncated IS), ``"mis"`` (masked IS), ``"seq_reject"`` (reject whole sequences) or
    ``"none"`` (see the objective module's docstring)."""

    is_cap: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 2.0
    """Truncation ``C`` of TIS (also applied inside ``seq_reject``): ``w -> min(w, C)``.
    Finite and >= 1, so agreeing logprobs (``w = 1``) pass unchanged."""

    is_low: Annotated[float, Field(gt=0, le=1)] = 0.5
    """Lower edge of the MIS band: tokens with ``w < is_low`` are dropped. In (0, 1]: ``w``
    is always positive, and ``w = 1`` must stay inside the band."""

    is_high: Annotated[float, Field(ge=1)] = 2.0
    """Upper edge of the MIS band: tokens with ``w > is_high`` are dropped. >= 1, so that
    ``w = 1`` stays inside the band."""

    seq_low: Annotated[float, Field(gt=0, le=1)] = 0.99
    """Lower edge for ``seq_reject``: a sequence whose geometric-mean token weight is below it
    is dropped. Roughly a bound on the mean per-token log weight (``log 0.99 ~ -0.01``). In
    (0, 1]: a sequence of agreeing tokens (geometric mean 1) must be kept."""

    seq_high: Annotated[float, Field(ge=1)] = 1.01
    """Upper edge for ``seq_reject``, counterpart of ``seq_low``. >= 1, so that a sequence of
    agreeing tokens is kept."""

    kl_coef: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    """Weight of a k3 KL penalty to the initial policy (as in GRPO). Finite and >= 0; 0
    disables it and keeps no reference model (many reasoning-RL recipes, DAPO and Dr. GRPO,
    drop it); > 0 keeps a frozen copy of the initial policy."""

    aggregation: Aggregation = "token_mean"
    """``"token_mean"``: sum over unmasked tokens / token count of the batch (every token
    weighs the same). ``"seq_mean"``: mean over each sequence's tokens, then over the
    batch's sequences (GRPO's original; every sequence weighs the same)."""


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

    t = _prepare(logp, proximal_logp, behaviour_logp, advantages, mask, seq_index, n_seqs,
                 n_tokens_total=n_tokens_total, n_seqs_total=n_seqs_total)
    surrogate, clipped_low, clipped_high = _clipped_surrogate(t, cfg)
    # Off-policy correction: constant per token, so it scales the gradient, never its
    # direction.
    corr = _CORRECTIONS[cfg.correction](t.proximal - t.behaviour, mask, t.seq, n_seqs, cfg)
    pg = _aggregate(-corr.weight * surrogate, t, cfg)
    kl = _aggregate(_k3_to_reference(t, ref_logp), t, cfg) if ref_logp is not None else t.zero
    loss = pg + cfg.kl_coef * kl if cfg.kl_coef > 0 else pg
    return loss, _loss_metrics(t, pg, kl, clipped_low, clipped_high, corr)


class _Tokens(NamedTuple):
    """One call's token tensors in the loss dtype, zeroed where not trained, with the normalisers."""

    mask: Tensor  # [T] bool: trained tokens
    logp: Tensor  # [T] current policy, carries the gradient
    proximal: Tensor  # [T] detached
    behaviour: Tensor  # [T] detached
    adv: Tensor  # [T] detached
    seq: Tensor  # [T] sequence of each token (0 where masked)
    seq_tokens: Tensor  # [n_seqs] trained tokens per sequence
    seq_present: Tensor  # [n_seqs] bool: the sequence has a trained token
    tokens_norm: Tensor  # token count of the whole batch
    seqs_norm: Tensor  # sequence count of the whole batch
    zero: Tensor  # scalar 0 in the loss dtype


def _prepare(logp: Tensor, proximal_logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor,
             seq_index: Tensor, n_seqs: int, *, n_tokens_total: int | None, n_seqs_total: int | None) -> _Tokens:
    dtype = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    token = mask.to(dtype)
    seq = torch.where(mask, seq_index, torch.zeros_like(seq_index))
    seq_tokens = torch.zeros(n_seqs, dtype=dtype, device=logp.device).index_add_(0, seq, token)
    seq_present = seq_tokens > 0
    return _Tokens(
        mask=mask,
        logp=_masked(logp, mask, zero),
        proximal=_masked(proximal_logp.detach(), mask, zero),
        behaviour=_masked(behaviour_logp.detach(), mask, zero),
        adv=_masked(advantages.detach(), mask, zero),
        seq=seq,
        seq_tokens=seq_tokens,
        seq_present=seq_present,
        tokens_norm=_normaliser(n_tokens_total, token.sum(), "n_tokens_total"),
        seqs_norm=_normaliser(n_seqs_total, seq_present.sum().to(dtype), "n_seqs_total"),
        zero=zero,
    )


def _masked(t: Tensor, mask: Tensor, zero: Tensor) -> Tensor:
    # Replace non-trained positions (padding may hold -inf or garbage) by 0 *before* any
    # arithmetic, so neither the loss nor its backward can see a NaN there.
    return torch.where(mask, t.to(zero.dtype), zero)


def _clipped_surrogate(t: _Tokens, cfg: ObjectiveConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token PPO surrogate in the trust region around the proximal policy, and the tokens
    whose gradient the lower / upper clip removed."""
    ratio = torch.exp((t.logp - t.proximal).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    lower, upper = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    # min(unclipped, clipped) is the pessimistic bound: it removes the incentive to move
    # the ratio outside [lower, upper] in the direction the advantage favours, and keeps
    # the full gradient when the move would undo a previous overshoot.
    surrogate = torch.minimum(ratio * t.adv, ratio.clamp(lower, upper) * t.adv)
    clipped_low = t.mask & (t.adv < 0) & (ratio < lower)
    clipped_high = t.mask & (t.adv > 0) & (ratio > upper)
    return surrogate, clipped_low, clipped_high


def _k3_to_reference(t: _Tokens, ref_logp: Tensor) -> Tensor:
    # k3 estimate of KL(policy || reference) per token (GRPO): with d = ref - logp,
    # exp(d) - 1 - d >= 0, unbiased when tokens come from the policy. They come from
    # the behaviour policy; the gap is the usual accepted approximation.
    d = (_masked(ref_logp.detach(), t.mask, t.zero) - t.logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.expm1(d) - d


def _aggregate(per_token: Tensor, t: _Tokens, cfg: ObjectiveConfig) -> Tensor:
    return _AGGREGATIONS[cfg.aggregation](per_token, t.mask, t.seq, t.seq_tokens, t.tokens_norm, t.seqs_norm)


def _loss_metrics(t: _Tokens, pg: Tensor, kl: Tensor, clipped_low: Tensor, clipped_high: Tensor,
                  corr: _Corrected) -> dict[str, float]:
    dtype, mask = t.zero.dtype, t.mask
    with torch.no_grad():
        values = torch.stack(
            [
                pg.detach(),
                kl.detach(),
                clipped_low.sum().to(dtype) / t.tokens_norm,
                clipped_high.sum().to(dtype) / t.tokens_norm,
                torch.where(mask, corr.weight, t.zero).sum() / t.tokens_norm,
                (corr.truncated & mask).sum().to(dtype) / t.tokens_norm,
                (corr.dropped & mask).sum().to(dtype) / t.tokens_norm,
                (corr.rejected_seqs & t.seq_present).sum().to(dtype) / t.seqs_norm,
            ]
        )
    # One device sync for all metrics.
    return dict(zip(POLICY_LOSS_METRICS, values.tolist(), strict=True))


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
