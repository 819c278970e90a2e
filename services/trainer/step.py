"""One optimiser step on a batch of scored groups: advantages, recompute, loss, update.

One step per batch, so the proximal policy of the decoupled objective is the trainer's own
forward at the start of the step (``logp.detach()``): no extra forward is needed, and the
importance weight proximal/behaviour measures exactly the training–inference gap plus staleness.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from rlbus.schemas.metric_keys import TrainerKeys
from rlbus.services.policy.logprobs import (
    LogprobInputError,
    check_sequences,
    completion_logprobs,
    shared_prefix_logprobs,
)
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.trainer.advantages import group_advantages
from rlbus.services.trainer.batch import GroupDecision
from rlbus.services.trainer.judge import InputLimits
from rlbus.services.trainer.mismatch import mismatch_metrics
from rlbus.services.trainer.objective import policy_loss
from rlbus.services.trainer.settings import TrainerSettings


@dataclass
class PackedSeq:
    prompt: list[int]
    completion: list[int]
    behaviour: torch.Tensor
    loss_mask: torch.Tensor
    advantage: float
    staleness: int
    sampling: SamplingParams
    exact: bool = False  # the generator labelled its behaviour logprobs exact (Rollout.exact_logprobs)


def make_optimizer(model: torch.nn.Module, cfg: TrainerSettings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def pack(batch: list[GroupDecision], cfg: TrainerSettings) -> tuple[list[PackedSeq], dict[str, float]]:
    """Advantages per group, then one PackedSeq per trained rollout."""
    n = max(len(d.group.scored) for d in batch)
    # Filled in numpy, then shared with torch: element-wise tensor writes cost ~1 us each.
    rewards_np = np.zeros((len(batch), n), dtype=np.float32)
    valid_np = np.zeros((len(batch), n), dtype=bool)
    base_np = np.zeros((len(batch), n), dtype=bool)
    for g, d in enumerate(batch):
        k = len(d.group.scored)
        base_np[g, :k] = d.baseline_mask
        valid_np[g, :k] = d.train_mask
        rewards_np[g, :k] = [s.reward if b else 0.0 for s, b in zip(d.group.scored, d.baseline_mask, strict=True)]
    rewards, valid, base = torch.from_numpy(rewards_np), torch.from_numpy(valid_np), torch.from_numpy(base_np)
    adv = group_advantages(rewards, valid=valid, baseline_mask=base, normalize_std=cfg.advantages.normalize_std,
                           baseline=cfg.advantages.baseline)
    seqs: list[PackedSeq] = []
    for g, d in enumerate(batch):
        sp = d.group.sampling
        params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_new_tokens)
        for i, s in enumerate(d.group.scored):
            if not d.train_mask[i]:
                continue
            r = s.rollout
            ids = r.token_ids.tolist()
            seqs.append(PackedSeq(prompt=ids[: r.prompt_len], completion=ids[r.prompt_len:],
                                  behaviour=torch.from_numpy(np.array(r.behaviour_logprobs, dtype=np.float32)),
                                  loss_mask=torch.from_numpy(np.array(r.loss_mask, dtype=bool)),
                                  advantage=float(adv[g, i]), staleness=d.staleness[i], sampling=params,
                                  exact=r.exact_logprobs))
    trained = valid.sum().item()
    stats = {"batch/groups": len(batch), "batch/rollouts_trained": trained,
             TrainerKeys.REWARD_MEAN: float(rewards[base].mean()) if base.any() else 0.0,
             "batch/accuracy": float((rewards[base] >= 1.0).float().mean()) if base.any() else 0.0,
             "batch/completion_len": float(np.mean([len(s.completion) for s in seqs])) if seqs else 0.0}
    # Policy turns per episode (1 for single-turn tasks): whether a tool task's episodes actually use the tool.
    turns = [s.rollout.turns for d in batch for i, s in enumerate(d.group.scored) if d.train_mask[i]]
    stats["batch/turns_mean"] = float(np.mean(turns)) if turns else 0.0
    stats["batch/multi_turn"] = float(np.mean([t >= 2 for t in turns])) if turns else 0.0
    return seqs, stats


def _logprobs(model: torch.nn.Module, seqs: list[PackedSeq], params: SamplingParams, deterministic: bool) -> list[torch.Tensor]:
    """Trainer logprobs with grad.  Deterministic mode: the batch-invariant per-sequence path the
    generator also uses.  Default: samples of one prompt share a single prompt forward."""
    if deterministic:
        return completion_logprobs(model, [(s.prompt, s.completion) for s in seqs], params, deterministic=True, grad=True)
    groups: list[tuple[list[int], list[list[int]]]] = []
    for s in seqs:  # pack() emits the samples of a group consecutively
        if groups and groups[-1][0] == s.prompt:
            groups[-1][1].append(s.completion)
        else:
            groups.append((s.prompt, [s.completion]))
    return [lp for g in shared_prefix_logprobs(model, groups, params, grad=True) for lp in g]


def _autocast(model: torch.nn.Module, cfg: TrainerSettings) -> contextlib.AbstractContextManager[None]:
    """bf16 matmuls over the float32 master weights ([trainer] autocast); the loss is computed in float32."""
    if cfg.autocast == "off" or cfg.deterministic:  # deterministic mode pins its own kernels and dtype
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def batch_counts(seqs: list[PackedSeq]) -> tuple[int, int]:
    """(trained tokens, sequences with at least one trained token) of the whole batch: the
    normalisers that make micro-batch (and per-rank) losses sum to the full-batch loss."""
    return int(sum(int(s.loss_mask.sum()) for s in seqs)), sum(1 for s in seqs if bool(s.loss_mask.any()))


def accumulate(model: torch.nn.Module, seqs: list[PackedSeq], cfg: TrainerSettings, ref_model: torch.nn.Module | None,
               *, n_tokens_total: int, n_seqs_total: int) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Forward/backward of ``seqs`` in micro-batches, gradients added to ``.grad``.  The loss is
    normalised by the given whole-batch counts, so any split of a batch (micro-batches, ranks)
    accumulates the full-batch gradient.  Returns the summed loss metrics and the detached
    trainer logprobs of each micro-batch, in ``seqs`` order."""
    obj = cfg.objective
    totals: dict[str, float] = {}
    trainer_lps: list[torch.Tensor] = []
    for start in range(0, len(seqs), cfg.micro_batch_seqs):
        chunk = seqs[start: start + cfg.micro_batch_seqs]
        # Sequences with different sampling params need their own processed distribution.
        by_params: dict[SamplingParams, list[int]] = {}
        for i, s in enumerate(chunk):
            by_params.setdefault(s.sampling, []).append(i)
        logps: list[torch.Tensor | None] = [None] * len(chunk)
        with _autocast(model, cfg):
            for params, idx in by_params.items():
                for i, lp in zip(idx, _logprobs(model, [chunk[i] for i in idx], params, cfg.deterministic), strict=True):
                    logps[i] = lp
        logp = torch.cat([lp for lp in logps if lp is not None]).float()
        device = logp.device  # .to() is free on CPU; on an accelerator the batch data follows the model
        behaviour = torch.cat([s.behaviour for s in chunk]).to(device)
        mask = torch.cat([s.loss_mask for s in chunk]).to(device)
        seq_index = torch.cat([torch.full((len(s.completion),), k, dtype=torch.long) for k, s in enumerate(chunk)]).to(device)
        advantages = torch.tensor([s.advantage for s in chunk], dtype=torch.float32, device=device)[seq_index]
        ref_logp = None
        if ref_model is not None and obj.kl_coef > 0:
            with torch.no_grad():
                ref_logp = torch.cat([lp for params, idx in by_params.items() for lp in completion_logprobs(
                    ref_model, [(chunk[i].prompt, chunk[i].completion) for i in idx], params,
                    deterministic=cfg.deterministic)])
        loss, m = policy_loss(logp, proximal_logp=logp.detach(), behaviour_logp=behaviour, advantages=advantages,
                              mask=mask, seq_index=seq_index, n_seqs=len(chunk), cfg=obj, ref_logp=ref_logp,
                              n_tokens_total=n_tokens_total, n_seqs_total=n_seqs_total)
        loss.backward()
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + v
        trainer_lps.append(logp.detach())
    return totals, trainer_lps


def step_metrics(seqs: list[PackedSeq], totals: dict[str, float], trainer_lp: torch.Tensor, grad_norm: float,
                 cfg: TrainerSettings, t0: float) -> dict[str, float]:
    """Metrics of a whole batch from its summed loss metrics and every token's trainer logprob."""
    behaviour_lp = torch.cat([s.behaviour for s in seqs])
    mask_all = torch.cat([s.loss_mask for s in seqs])
    seq_all = torch.cat([torch.full((len(s.completion),), k, dtype=torch.long) for k, s in enumerate(seqs)])
    metrics = dict(totals)
    obj = cfg.objective
    metrics.update(mismatch_metrics(trainer_lp, behaviour_lp, mask_all, seq_all, is_low=obj.is_low,
                                    is_high=obj.is_high, is_cap=obj.is_cap))
    # The gap above mixes two causes: staleness (the sample came from an older version) and
    # numerics (same version, different kernels/precision).  Tokens of fresh samples isolate the
    # numerical training-inference gap.
    fresh_seq = torch.tensor([s.staleness == 0 for s in seqs], dtype=torch.bool)
    fresh_tok = mask_all & fresh_seq[seq_all]
    metrics["mismatch_fresh/tokens"] = float(fresh_tok.sum())
    if bool(fresh_tok.any()):
        fresh = mismatch_metrics(trainer_lp, behaviour_lp, fresh_tok, seq_all, is_low=obj.is_low,
                                 is_high=obj.is_high, is_cap=obj.is_cap)
        for key in ("abs_diff_mean", "abs_diff_max", "k3_kl"):
            metrics[f"mismatch_fresh/{key}"] = fresh[f"mismatch/{key}"]
    metrics.update(_exact_metrics(seqs, trainer_lp, behaviour_lp, fresh_tok, seq_all, trained=int(mask_all.sum())))
    metrics["mismatch/ratio_first_token"] = float(torch.exp(trainer_lp[0] - behaviour_lp[0])) if len(trainer_lp) else 1.0
    metrics["train/grad_norm"] = grad_norm
    metrics["train/skipped_nonfinite"] = 0.0 if math.isfinite(grad_norm) else 1.0
    metrics["train/tokens"] = float(int(mask_all.sum()))
    metrics["train/step_s"] = time.perf_counter() - t0
    stal = [s.staleness for s in seqs]
    metrics["staleness/mean"] = float(np.mean(stal)) if stal else 0.0
    metrics["staleness/max"] = float(max(stal)) if stal else 0.0
    for k in range(0, 5):
        metrics[f"staleness/hist_{k}"] = float(sum(1 for x in stal if x == k))
    metrics["staleness/hist_5plus"] = float(sum(1 for x in stal if x >= 5))
    return metrics


def _exact_metrics(seqs: list[PackedSeq], trainer_lp: torch.Tensor, behaviour_lp: torch.Tensor,
                   fresh_tok: torch.Tensor, seq_all: torch.Tensor, *, trained: int) -> dict[str, float]:
    """The exactness claim of deterministic mode, checked every step: over the trained tokens of
    fresh samples whose generator labelled them exact, the largest |trainer - behaviour| logprob
    (0 when the claim holds), and how many trained tokens the claim does not cover (stale samples,
    tokens spanning a swap, multi-turn episodes): counted, never silently mixed in."""
    exact_seq = torch.tensor([s.exact for s in seqs], dtype=torch.bool)
    exact_tok = fresh_tok & exact_seq[seq_all]
    out = {"mismatch_exact/tokens": float(exact_tok.sum()), "mismatch_exact/excluded_tokens": float(trained - int(exact_tok.sum()))}
    if bool(exact_tok.any()):
        out["mismatch_exact/abs_diff_max"] = float((trainer_lp[exact_tok] - behaviour_lp[exact_tok]).abs().max())
    return out


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seqs: list[PackedSeq], cfg: TrainerSettings,
               ref_model: torch.nn.Module | None = None) -> dict[str, float]:
    """Forward/backward in micro-batches (exact accumulation), clip, step.  Returns metrics."""
    t0 = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    n_tokens_total, n_seqs_total = batch_counts(seqs)
    try:
        totals, trainer_lps = accumulate(model, seqs, cfg, ref_model, n_tokens_total=n_tokens_total,
                                         n_seqs_total=n_seqs_total)
    except LogprobInputError:
        # The caller refuses the batch's bad groups and goes on: leave no half-accumulated
        # gradient behind, and the model as a step leaves it.
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        raise
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    if math.isfinite(grad_norm):
        optimizer.step()
    model.eval()
    return step_metrics(seqs, totals, torch.cat(trainer_lps), grad_norm, cfg, t0)


def step_refusals(batch: list[GroupDecision], limits: InputLimits) -> dict[str, str]:
    """After a step raised ``LogprobInputError``: which groups of ``batch`` it came from (id -> why),
    found by the very check the step runs, one trained rollout at a time."""
    refused: dict[str, str] = {}
    for d in batch:
        for s, trained in zip(d.group.scored, d.train_mask, strict=True):
            if not trained:
                continue
            r = s.rollout
            ids = np.asarray(r.token_ids).tolist()
            try:
                check_sequences([(ids[: r.prompt_len], ids[r.prompt_len:])], limits.max_positions, limits.vocab_size)
            except LogprobInputError as exc:
                refused[d.group.task.task_id] = f"the training step refused rollout {r.rollout_id!r}: {exc}"
                break
    return refused
