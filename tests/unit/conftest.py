"""Fixtures the policy tests share: the character tokenizer and an untrained tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from rlbus.services.policy.model_init import tiny_config
from rlbus.services.policy.tokenizer import build_char_tokenizer


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


@pytest.fixture(scope="module")
def long_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """The tiny model with a 256-token context: room for rows past ~128 tokens, where the attention
    product's reduction order starts to depend on the padded length, and past the 192 keys that
    deterministic decoding covers."""
    cfg = tiny_config(tokenizer)
    cfg.max_position_embeddings = 256
    torch.manual_seed(1)
    return Qwen2ForCausalLM(cfg).eval()
