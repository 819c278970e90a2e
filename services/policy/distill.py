"""Distilling the draft model on the policy's own samples (a library; the `speculator` service,
services/speculator/, runs it on the scored stream).

Why cross-entropy on sampled tokens is distillation: every completion token the policy sampled
is a draw from its processed distribution p(. | prefix), so the expected loss
E_{x~p}[-log q(x)] = H(p) + KL(p || q) is minimised by q = p, and its gradient is an unbiased
estimate of the gradient of KL(p || q). Rollouts already in the stream are therefore enough; the
policy's full distributions (V floats per token) never have to travel.

What is trained: the draft's distribution at the policy's sampling temperature (logits / T),
since that is the q the drafter samples and the acceptance rule compares with p. Only tokens
the policy sampled count (`loss_mask`: 0 marks tokens an environment inserted, whose
distribution is not the policy's); prompt tokens never do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from rlbus.services.policy.errors import PolicyError


class DistillInputError(PolicyError):
    """A sample or a setting given to the distiller cannot be trained on."""


@dataclass(frozen=True)
class PolicySample:
    """One rollout as the trainer sees it: token ids and which completion tokens the policy sampled."""

    prompt: Sequence[int]
    completion: Sequence[int]
    loss_mask: Sequence[int] | None = None  # per completion token, 1 = sampled by the policy; None = all

    def mask(self) -> list[int]:
        return [1] * len(self.completion) if self.loss_mask is None else [int(m) for m in self.loss_mask]


class DraftDistiller:
    """Optimiser steps on a draft model towards the policy whose samples it is given."""

    def __init__(self, draft: PreTrainedModel, *, temperature: float = 1.0, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.98), max_grad_norm: float = 1.0) -> None:
        if not temperature > 0.0:
            raise DistillInputError(f"temperature={temperature}: distil at the policy's sampling temperature (> 0); "
                                    "a greedy policy's samples carry no distribution to match")
        if not lr > 0.0:
            raise DistillInputError(f"lr={lr}: use a learning rate > 0")
        self.draft = draft
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, betas=betas, weight_decay=0.0)
        self.steps = 0

    def check(self, sample: PolicySample, i: int = 0) -> tuple[list[int], list[int]]:
        """(the sample's ids, its loss mask), or `DistillInputError` saying why it cannot be trained on.
        Public so a caller that buffers samples (the speculator) refuses a bad one when it arrives,
        not inside a later minibatch of good ones."""
        mask = sample.mask()
        if len(mask) != len(sample.completion):
            raise DistillInputError(f"sample {i}: loss_mask has {len(mask)} entries for {len(sample.completion)} "
                                    "completion tokens: give one per completion token")
        vocab = int(self.draft.config.vocab_size)
        seq = [int(t) for t in (*sample.prompt, *sample.completion)]
        if not sample.prompt or any(t < 0 or t >= vocab for t in seq):
            raise DistillInputError(f"sample {i}: empty prompt or a token id outside the draft's vocabulary "
                                    f"({vocab}): distil on the policy's own token ids")
        context = getattr(self.draft.config, "max_position_embeddings", None)
        if context is not None and len(seq) > context:
            raise DistillInputError(f"sample {i} has {len(seq)} tokens, the draft's context is {context}")
        return seq, mask

    def _batch(self, samples: Sequence[PolicySample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ids, attention mask, and next-token targets (-100 where no loss)."""
        rows = []
        for i, s in enumerate(samples):
            seq, mask = self.check(s, i)
            rows.append((seq, len(s.prompt), mask))
        width = max(len(seq) for seq, _, _ in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        attention = torch.zeros_like(ids)
        targets = torch.full((len(rows), width - 1), -100, dtype=torch.long)
        for r, (seq, plen, mask) in enumerate(rows):
            ids[r, : len(seq)] = torch.tensor(seq)
            attention[r, : len(seq)] = 1
            # Position j predicts token j + 1: completion token c sits at plen + c.
            for c, m in enumerate(mask):
                if m:
                    targets[r, plen + c - 1] = seq[plen + c]
        device = next(self.draft.parameters()).device
        return ids.to(device), attention.to(device), targets.to(device)

    def step(self, samples: Sequence[PolicySample]) -> float:
        """One optimiser step on `samples`; the mean loss per trained token (nats)."""
        if not samples:
            raise DistillInputError("no samples: pass at least one rollout")
        ids, attention, targets = self._batch(samples)
        if not bool((targets != -100).any()):
            raise DistillInputError("no token to train on: every loss_mask entry is 0")
        self.draft.train()
        logits = self.draft(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy((logits / self.temperature).reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1), ignore_index=-100)
        value = float(loss.item())
        if not math.isfinite(value):  # checked before stepping, so the draft stays usable
            self.draft.eval()
            raise DistillInputError(f"loss is {value} at step {self.steps + 1}: lower lr; the draft was not updated")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.draft.eval()
        self.steps += 1
        return value

    def fit(self, samples: Sequence[PolicySample], steps: int, batch_size: int = 32, seed: int = 0) -> list[float]:
        """`steps` optimiser steps over shuffled minibatches of `samples` (cycling); the losses."""
        if steps < 0 or batch_size < 1 or not samples:
            raise DistillInputError(f"steps={steps}, batch_size={batch_size}: use steps >= 0 and batch_size >= 1, "
                                    "with at least one sample")
        order: list[int] = []
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(steps):
            while len(order) < min(batch_size, len(samples)):
                order += torch.randperm(len(samples), generator=gen).tolist()
            batch, order = order[:batch_size], order[batch_size:]
            losses.append(self.step([samples[i] for i in batch]))
        return losses
