"""Deterministic mode on a real pretrained model: SmolLM2-135M-Instruct (Llama, head_dim 64, 9 query and
3 key-value heads, vocabulary 49,152) is not the shape the kernel facts were first measured on.  The
facts are checked for its shape (``exact_check``), and the sampler's behaviour log-probs are then the
trainer's, bit for bit, on chat-template prompts; with the facts broken (two threads here) deterministic
mode is refused with the fact that failed, not run with a nonzero gap."""

from __future__ import annotations

import pytest
import torch

from rlbus.services.policy.exact_check import DeterministicUnsupported, ModelShape, require_exact_kernels, violations
from rlbus.services.policy.load import load_policy
from rlbus.services.policy.sampler import GroupSampler, StaticSlot
from rlbus.services.policy.sampling import SamplingParams
from tests.unit.exactness import check_against_trainer


@pytest.fixture(scope="module")
def smollm2(smollm2_model):
    torch.set_num_threads(1)
    model, tokenizer = load_policy(smollm2_model)
    return model.eval(), tokenizer


def test_the_kernel_facts_hold_for_smollm2s_shape_on_one_thread(smollm2) -> None:
    model, _ = smollm2
    shape = ModelShape.of(model.config)
    assert (shape.head_dim, shape.heads, shape.kv_heads, shape.vocab) == (64, 9, 3, 49152)
    assert violations(shape, torch.float32, 1) == ()
    require_exact_kernels(model)


def test_decoded_logprobs_are_the_trainers_on_chat_prompts(smollm2) -> None:
    model, tokenizer = smollm2
    questions = ["State the final answer to the following arithmetic problem: 4 - 1 =", "What is 12 + 30?"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)
    groups = GroupSampler(StaticSlot(model), deterministic=True).sample_groups(
        prompts, 4, params, torch.Generator().manual_seed(3))
    assert sum(len(s.completion_ids) for g in groups for s in g) > 8
    sources = check_against_trainer(model, prompts, groups, params)
    assert set(sources) <= {"decoded", "recomputed"}, sources


def test_broken_facts_refuse_deterministic_mode_with_the_reason(smollm2, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = smollm2
    found = violations(ModelShape.of(model.config), torch.float32, 2)
    if not found:
        pytest.skip("two threads keep the facts on this machine: nothing to refuse")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with pytest.raises(DeterministicUnsupported, match="linear layer|attention query") as err:
        require_exact_kernels(model)
    assert "2 torch threads" in str(err.value) and "one thread per process" in str(err.value)
