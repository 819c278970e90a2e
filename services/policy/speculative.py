"""Exact speculative sampling: accept or reject drafted tokens so the output is distributed as
if every token had been sampled from the target policy.

Why it exists: drafting pays in the long tail of a rollout batch, where few rows are left and a
target forward over k+1 tokens costs about as much as over one. In RL the drafted tokens become
training data, so drafting must not change their distribution (greedy matching would: it
over-samples the drafter's guesses). The rule here is the standard rejection rule: a drafted token
x drawn from the drafter's q is kept with probability min(1, p(x)/q(x)); at the first rejection
the replacement is drawn from the residual norm(max(p - q, 0)); when all k are kept one bonus
token is drawn from p at position k+1. Each emitted token is then distributed exactly as p given
its prefix, for ANY q, which is why the drafter can be a heuristic (a deterministic drafter such
as suffix matching is a point mass, q = one-hot).

p is the target's *processed* distribution (`processed_logprobs`: temperature and top-p), so the
behaviour log-prob returned for each token is log p(x), the same value the plain sampler would
record; mismatch metrics, TIS and the deterministic checks downstream see nothing new.

I/O-free and batched over rows; randomness only from the `torch.Generator` passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlbus.services.policy.errors import PolicyError


class SpeculativeInputError(PolicyError):
    """The target and draft tensors given to `accept_drafts` do not describe one verification."""


@dataclass
class Verified:
    """The outcome of verifying one round of drafts, per row.

    Row r emitted `tokens[r, :emitted[r]]`: its first `accepted[r]` drafted tokens, then one
    correction (after a rejection) or bonus (all kept) token, so `emitted == accepted + 1`.
    `logprobs` are the target's processed log-probs of those tokens (the behaviour log-probs);
    entries past `emitted` are padding (token 0, log-prob 0).
    """

    tokens: torch.Tensor  # [B, k+1] long
    logprobs: torch.Tensor  # [B, k+1] float32
    accepted: torch.Tensor  # [B] long, drafted tokens kept
    emitted: torch.Tensor  # [B] long, accepted + 1

    def rows(self) -> list[tuple[list[int], np.ndarray]]:
        """Per row: (emitted token ids, their behaviour log-probs as float32)."""
        tokens = self.tokens.tolist()
        logps = self.logprobs.cpu().numpy()
        return [(tokens[r][:n], logps[r, :n].copy()) for r, n in enumerate(self.emitted.tolist())]


def _check(target_logprobs: torch.Tensor, draft_ids: torch.Tensor, draft_lens: torch.Tensor,
           draft_probs: torch.Tensor | None) -> None:
    if target_logprobs.dim() != 3:
        raise SpeculativeInputError(
            f"target_logprobs has shape {tuple(target_logprobs.shape)}: pass [rows, k+1, vocab], the "
            "processed log-probs at the position before each drafted token and after the last one")
    rows, positions, vocab = target_logprobs.shape
    if tuple(draft_ids.shape) != (rows, positions - 1):
        raise SpeculativeInputError(
            f"draft_ids has shape {tuple(draft_ids.shape)} but target_logprobs {tuple(target_logprobs.shape)} "
            f"needs [{rows}, {positions - 1}]: one target position per drafted token plus one for the bonus")
    if tuple(draft_lens.shape) != (rows,) or bool((draft_lens < 0).any()) or bool((draft_lens > positions - 1).any()):
        raise SpeculativeInputError(
            f"draft_lens must be [{rows}] with values in 0..{positions - 1} (shorter drafts are right-padded)")
    if draft_probs is not None and tuple(draft_probs.shape) != (rows, positions - 1, vocab):
        raise SpeculativeInputError(
            f"draft_probs has shape {tuple(draft_probs.shape)}: pass [{rows}, {positions - 1}, {vocab}], the "
            "drafter's distribution each token was drawn from, or None for a deterministic drafter")


def accept_drafts(
    target_logprobs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_lens: torch.Tensor,
    generator: torch.Generator,
    *,
    draft_probs: torch.Tensor | None = None,
    greedy: bool = False,
) -> Verified:
    """Verify each row's drafted tokens against the target (see the module docstring).

    target_logprobs: [B, k+1, V] processed log-probs from ONE target forward over the last
      accepted token and the k drafted ones: position j is the distribution of drafted token j,
      position k that of the bonus token.
    draft_ids: [B, k] drafted ids, right-padded where a row drafted fewer (`draft_lens`).
    draft_probs: [B, k, V] the drafter's distributions, or None for a deterministic drafter
      (a point mass on each drafted id).
    greedy: temperature 0. The target is then a point mass on its argmax, and drafts are kept
      while they equal it; no randomness is drawn, as in the plain sampler's greedy mode.
    """
    _check(target_logprobs, draft_ids, draft_lens, draft_probs)
    rows, positions, _ = target_logprobs.shape
    k = positions - 1
    device = target_logprobs.device
    lp = target_logprobs.float()
    slot = torch.arange(k, device=device)
    in_draft = slot[None, :] < draft_lens[:, None]
    p_draft = lp[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1).exp()  # p(x_j)
    if greedy:
        keep = draft_ids == lp[:, :k].argmax(dim=-1)
    else:
        q_draft = torch.ones_like(p_draft) if draft_probs is None else (
            draft_probs.float().gather(-1, draft_ids[..., None]).squeeze(-1))
        # u * q < p keeps with probability min(1, p/q) without dividing: u is in [0, 1), so
        # p == 0 never keeps and p >= q always keeps. (q(x) == 0 cannot happen for a token the
        # drafter really drew; it then keeps whenever p(x) > 0, the limit of the rule.)
        u = torch.rand((rows, k), generator=generator, device=generator.device).to(device)
        keep = u * q_draft < p_draft
    keep &= in_draft
    # Drafts are kept only up to the first rejection.
    accepted = keep.long().cumprod(dim=-1).sum(dim=-1)
    p_next = lp.gather(1, accepted[:, None, None].expand(-1, 1, lp.shape[-1])).squeeze(1).exp()
    rejected = accepted < draft_lens
    if greedy:
        final = p_next.argmax(dim=-1)
    else:
        weights = p_next
        if bool(rejected.any()):
            at = accepted.clamp(max=max(k - 1, 0))
            if draft_probs is None:
                q_next = torch.zeros_like(p_next).scatter(-1, draft_ids.gather(1, at[:, None]), 1.0)
            else:
                q_next = draft_probs.float().gather(1, at[:, None, None].expand(-1, 1, p_next.shape[-1])).squeeze(1)
            residual = (p_next - q_next).clamp(min=0.0)
            # A rejection with an empty residual only happens through float rounding (p == q
            # everywhere keeps every draft); p itself is then the right distribution.
            usable = rejected & (residual.sum(dim=-1) > 0)
            weights = torch.where(usable[:, None], residual, p_next)
        final = torch.multinomial(weights.to(generator.device), 1, generator=generator).squeeze(-1).to(device)
    tokens = torch.zeros((rows, positions), dtype=torch.long, device=device)
    tokens[:, :k] = torch.where(slot[None, :] < accepted[:, None], draft_ids, 0)
    tokens.scatter_(1, accepted[:, None], final[:, None])
    emitted = accepted + 1
    logprobs = lp.gather(-1, tokens[..., None]).squeeze(-1)
    logprobs = torch.where(torch.arange(positions, device=device)[None, :] < emitted[:, None], logprobs, 0.0)
    return Verified(tokens=tokens, logprobs=logprobs, accepted=accepted, emitted=emitted)
