"""The bench's reference speculative loop (bench/speculative_accept.py) on the tiny policy: the
KV cache with masked-out rejected drafts and explicit positions must give the target's own
samples. Greedy: exactly the plain sampler's completions whatever is drafted. Sampled: the
completions' distribution matches plain sampling (two-sample chi-square, false-alarm rate 1e-3
over seeds; the seed is fixed). Both fail when rejected drafts are left unmasked in the cache
(checked by hand: the sampled test then gives p ~ 1e-88)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from bench.speculative_accept import Counts, speculative_decode
from rlbus.services.policy.drafters import GroupDrafter
from rlbus.services.policy.load import load_policy
from rlbus.services.policy.sampler import GroupSampler, StaticSlot
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.policy.tokenizer import encode_prompt
from tests.unit.stats import same_distribution_p


def test_greedy_speculative_decoding_equals_plain_greedy(tiny_model: Path) -> None:
    torch.set_num_threads(1)
    model, tok = load_policy(tiny_model)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    sampler = GroupSampler(StaticSlot(model))
    for text in ("123+456=", "7+95=", "400+600="):
        prompt = encode_prompt(tok, text)
        with torch.no_grad():
            plain = sampler.sample_groups([prompt], 1, params)[0][0].completion_ids
            drafter = GroupDrafter(4)
            drafter.add_reference(plain)  # right drafts for every row...
            drafter.add_reference([plain[0], (plain[1] + 1) % 10, 5, 5, 5])  # ...and wrong ones
            counts = Counts()
            out = speculative_decode(model, prompt, drafter, 4, 4, params, torch.Generator(), counts)
        assert out == [plain] * 4
        assert counts.kept > 0 and counts.kept < counts.drafted  # both paths were exercised


def test_sampled_speculative_decoding_matches_plain_sampling(tiny_model: Path) -> None:
    torch.set_num_threads(1)
    model, tok = load_policy(tiny_model)
    params = SamplingParams(temperature=1.3, top_p=0.95, max_new_tokens=5)
    prompt = encode_prompt(tok, "58+67=")
    rows = 1500
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        plain = [tuple(s.completion_ids) for s in
                 GroupSampler(StaticSlot(model)).sample_groups([prompt], rows, params, generator=gen)[0]]
        drafter = GroupDrafter(rows)
        for reference in sorted(set(plain))[:20]:  # drafts that are sometimes right, often wrong
            drafter.add_reference(list(reference))
        counts = Counts()
        spec = [tuple(c) for c in speculative_decode(model, prompt, drafter, rows, 4, params, gen, counts)]
    assert counts.kept > 0 and counts.kept < counts.drafted
    p_value = same_distribution_p(plain, spec)
    assert p_value > 1e-3, (p_value, Counter(plain).most_common(5), Counter(spec).most_common(5))
