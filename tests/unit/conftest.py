"""Fixtures the policy tests share: the character tokenizer and an untrained tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from services.policy.model_init import tiny_config
from services.policy.tokenizer import build_char_tokenizer


def fresh_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Qwen2ForCausalLM:
    # An untrained model spreads its mass over many tokens: a harder case for top-p and for
    # logprob agreement than a confident trained one.
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config(tokenizer)).eval()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    return fresh_model(tokenizer)
