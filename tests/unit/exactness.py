"""The check every deterministic-decoding test makes: each sample's behaviour log-probs are the
trainer's own function's, bit for bit, computed in train mode with autograd on."""

from __future__ import annotations

import torch

from rlbus.services.policy.logprobs import completion_logprobs
from rlbus.services.policy.sampler import SampleOut
from rlbus.services.policy.sampling import SamplingParams


def check_against_trainer(model: torch.nn.Module, prompts: list[list[int]], groups: list[list[SampleOut]],
                           params: SamplingParams) -> dict[str, int]:
    pairs = [(p, s.completion_ids) for p, g in zip(prompts, groups, strict=True) for s in g]
    model.train()
    try:
        trainer = completion_logprobs(model, pairs, params, deterministic=True, grad=True)
    finally:
        model.eval()
    sources: dict[str, int] = {}
    for i, (sample, lp) in enumerate(zip([s for g in groups for s in g], trainer, strict=True)):
        sources[sample.logprobs_source] = sources.get(sample.logprobs_source, 0) + 1
        if sample.completion_ids:
            assert sample.logprobs_source in ("decoded", "recomputed")
            assert torch.equal(torch.from_numpy(sample.behaviour_logprobs), lp.detach()), f"sample {i} differs"
    return sources
