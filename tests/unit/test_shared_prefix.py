"""The trainer's shared-prompt forward equals the full recompute, values and gradients."""

from __future__ import annotations

import torch
from transformers import Qwen2ForCausalLM

from rlbus.services.policy.logprobs import completion_logprobs, shared_prefix_logprobs
from rlbus.services.policy.model_init import tiny_config
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.policy.tokenizer import build_char_tokenizer


def _model() -> Qwen2ForCausalLM:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny_config(build_char_tokenizer())).eval()


def _grads(model: torch.nn.Module, logps: list[torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad()
    torch.cat(logps).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_shared_prefix_matches_full_recompute_with_padding_and_uneven_groups() -> None:
    model = _model()
    g = torch.Generator().manual_seed(1)
    groups = []
    for plen, n in ((9, 3), (7, 1), (9, 4), (5, 2)):  # uneven prompt lengths and group sizes
        prompt = torch.randint(4, 70, (plen,), generator=g).tolist()
        comps = [torch.randint(4, 70, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
        groups.append((prompt, comps))
    params = SamplingParams(temperature=0.8, top_p=1.0)
    flat = [(p, c) for p, cs in groups for c in cs]
    full = completion_logprobs(model, flat, params, grad=True)
    shared = [lp for grp in shared_prefix_logprobs(model, groups, params, grad=True) for lp in grp]
    assert [len(x) for x in full] == [len(x) for x in shared]
    assert torch.allclose(torch.cat(full), torch.cat(shared), atol=1e-5)
    for a, b in zip(_grads(model, full), _grads(model, shared), strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)
