"""Deterministic decoding in the trainer's layout: the sampler's log-probs are the trainer's bits.

`services/policy/exact_attention.py` rests on measured properties of this CPU's kernels; the first
tests pin them, so a torch or MKL update that changes them fails here, by name, rather than as a
nonzero mismatch somewhere in a run. The others check the sampler against the trainer's function
on mixed prompt lengths, small groups, top-p, train mode with autograd, and sequences longer than
the decoded range (recomputed instead).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2ForCausalLM

from rlbus.services.policy.exact import MIN_ROWS
from rlbus.services.policy.exact_attention import DECODE_EXACT_KEYS, KEY_BLOCK, MIN_QUERY, exact_attention
from rlbus.services.policy.sampler import GroupSampler, StaticSlot
from rlbus.services.policy.sampling import SamplingParams
from tests.unit.exactness import check_against_trainer

torch.set_num_threads(1)


class _Heads(torch.nn.Module):
    num_key_value_groups = 2


def test_linear_rows_keep_their_bits_from_min_rows_up() -> None:
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(512, 128, generator=g), torch.randn(1024, 128, generator=g)
    big = F.linear(x, weight)
    for rows in (MIN_ROWS, 9, 31, 256):
        assert torch.equal(F.linear(x[:rows], weight), big[:rows]), f"{rows} rows took another path"


def test_one_query_gets_the_bits_of_a_long_query_block_and_any_key_padding() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, h, n, 32, generator=g) for h, n in ((4, 40), (2, DECODE_EXACT_KEYS), (2, DECODE_EXACT_KEYS)))
    lowest = torch.finfo(torch.float32).min
    for real in (5, 17, 40, DECODE_EXACT_KEYS - 3):
        block, _ = exact_attention(_Heads(), q, k[:, :, :real], v[:, :, :real], None)
        # Query i of the block sees keys [0, real - 40 + i]; alone, with keys padded by a mask.
        for i in (0, 13, 39):
            seen = real - 40 + i + 1
            if seen < 1:
                continue
            for width in sorted({seen, -(-seen // KEY_BLOCK) * KEY_BLOCK, DECODE_EXACT_KEYS}):
                mask = torch.zeros(1, 1, 1, width).masked_fill(torch.arange(width) >= seen, lowest)
                one, _ = exact_attention(_Heads(), q[:, :, i: i + 1], k[:, :, :width], v[:, :, :width], mask)
                assert torch.equal(one[:, 0], block[:, i]), f"real {real} query {i} width {width}"
    assert MIN_QUERY == 4  # 1-3 query rows took another path (measured); the kernel pads up to 4


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1, *(rng.randrange(3, vocab) for _ in range(n - 1))] for n in lengths]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_decoded_logprobs_are_the_trainers_across_prompt_buckets(model: Qwen2ForCausalLM, temperature: float,
                                                                 top_p: float) -> None:
    # Prompts of 3-20 tokens fall in several prompt buckets, each decoded as its own group; with
    # n = 3 one prompt alone is a group of 3 rows, under MIN_ROWS, so fill rows are decoded too.
    prompts = _prompts(2, [9, 9, 3, 12, 20, 15, 9], model.config.vocab_size)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=30)
    groups = GroupSampler(StaticSlot(model), deterministic=True).sample_groups(prompts, 3, params, torch.Generator().manual_seed(5))
    sources = check_against_trainer(model, prompts, groups, params)
    assert sources.get("decoded", 0) >= 18 and "recomputed" not in sources  # all within DECODE_EXACT_KEYS


def test_rows_past_the_decoded_range_are_recomputed_and_still_exact(long_model: Qwen2ForCausalLM,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # No end-of-sequence: every completion runs to max_new_tokens, so the lengths are known.
    monkeypatch.setattr(long_model.generation_config, "eos_token_id", None)
    monkeypatch.setattr(long_model.config, "eos_token_id", None)
    prompts = _prompts(4, [40, 150, 9], long_model.config.vocab_size)
    params = SamplingParams(max_new_tokens=80, stop_token_ids=())
    groups = GroupSampler(StaticSlot(long_model), deterministic=True).sample_groups(prompts, 2, params, torch.Generator().manual_seed(6))
    sources = check_against_trainer(long_model, prompts, groups, params)
    # 150 + 80 tokens pass DECODE_EXACT_KEYS: recomputed; 9 + 80 stays within: decoded.
    assert sources.get("recomputed", 0) >= 2 and sources.get("decoded", 0) >= 2
