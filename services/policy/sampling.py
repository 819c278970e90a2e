"""Sampling parameters and THE function that turns logits into the sampled distribution.

Why it exists: training–inference consistency (design invariant 3) is only meaningful if the
generator's behaviour logprobs and the trainer's recomputed logprobs describe the same
distribution. Both sides call `processed_logprobs`, so temperature and top-p are applied the
same way, in the same order, in float32, on both sides; a mismatch can then only come from
the forward pass, which is what the mismatch metrics are meant to measure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlbus.services.policy.errors import PolicyError


class SamplingParamsError(PolicyError):
    """A sampling parameter is outside its valid range."""


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled. `temperature == 0` means greedy (a point mass)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise SamplingParamsError(f"temperature={self.temperature}: use a value >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p={self.top_p}: use a value in (0, 1]")
        if self.max_new_tokens < 1:
            raise SamplingParamsError(f"max_new_tokens={self.max_new_tokens}: use a value >= 1")
        # Accept lists from configs but keep the frozen dataclass hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from, over the last dimension.

    logits / temperature, then the top-p nucleus (smallest set of most likely tokens whose
    mass reaches `top_p`, always at least one token) renormalised; tokens outside the nucleus
    get -inf. `temperature == 0` is greedy: log-prob 0 on the argmax, -inf elsewhere.
    Computed in float32 whatever the model dtype. Differentiable w.r.t. `logits` (the
    nucleus membership itself is a constant of the step, as it is for the sampler).
    """
    logits = logits.float()
    if temperature == 0.0:
        greedy = logits.argmax(dim=-1, keepdim=True)
        out = torch.full_like(logits, float("-inf"))
        # 0 + 0 * logit keeps the result attached to the graph (its gradient is zero).
        return out.scatter(-1, greedy, logits.gather(-1, greedy) * 0.0)
    scaled = logits / temperature
    if top_p < 1.0:
        with torch.no_grad():
            probs = torch.softmax(scaled, dim=-1)
            sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
            # Mass strictly before each token: a token is in the nucleus when that mass has not
            # reached top_p yet. The most likely token always has 0 before it, so it stays.
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            keep_sorted = mass_before < top_p
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)
