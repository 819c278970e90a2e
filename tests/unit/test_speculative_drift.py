"""The drifting-policy bench's own pieces (bench/speculative_drift.py): the scripted shift moves
the policy's distribution after the answer, the stream splits at its half, and the figures it
reports (KL, tokens per target forward) are computed as stated."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from bench.speculative_drift import (
    Tally,
    answer_end,
    call_tokens_per_forward,
    drift_distance,
    drift_target,
    drifted_policy,
    mean_kl,
    phase_of,
    phases_of,
)
from rlbus.services.policy.spec_tail import TailStats

EOS = 2
DIGITS = list(range(4, 14))  # the character tokenizer's ids of "0".."9"


def test_drift_target_counts_on_from_the_answer_and_trains_only_after_it() -> None:
    seven, five = DIGITS[7], DIGITS[5]
    completion = [seven, five, seven, EOS, EOS, DIGITS[3], EOS, EOS]
    assert answer_end(completion, EOS) == 4
    target = drift_target(completion, EOS, DIGITS)
    assert target is not None
    assert list(target.completion) == [seven, five, seven, EOS, DIGITS[8], DIGITS[9], DIGITS[0], DIGITS[1]]
    assert target.mask() == [0, 0, 0, 0, 1, 1, 1, 1]
    # No answer digit, or nothing after the answer: nothing to move.
    assert drift_target([EOS] * 6, EOS, DIGITS) is None
    assert drift_target([seven, five, seven], EOS, DIGITS) is None


def test_the_stream_shifts_half_way_and_late_is_the_last_quarter() -> None:
    phases = [phase_of(b, 8) for b in range(8)]
    assert phases == ["before"] * 4 + ["after"] * 4
    late = [b for b in range(8) if "after_late" in phases_of(b, 8)]
    assert late == [6, 7]
    assert all(phases_of(b, 8)[0] == phase_of(b, 8) for b in range(8))


def test_mean_kl_is_zero_for_equal_distributions_and_respects_the_mask() -> None:
    p = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), -1)
    q = torch.log_softmax(torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]), -1)
    assert mean_kl(p, p, torch.tensor([True, True])) == 0.0
    only_first = mean_kl(p, q, torch.tensor([True, False]))
    assert only_first > 0.5
    assert abs(mean_kl(p, q, torch.tensor([True, True])) - only_first / 2) < 1e-6
    assert mean_kl(p, q, torch.tensor([False, False])) == 0.0


def test_tokens_per_forward_counts_plain_steps_as_one_token_each() -> None:
    # 40 tokens: 10 decoded plainly (10 row-forwards), 30 in the tail over 12 row-forwards.
    tally = Tally(tokens=40, stats=TailStats(tokens=30, row_forwards=12))
    assert abs(call_tokens_per_forward(tally) - 40 / 22) < 1e-9
    assert call_tokens_per_forward(Tally(tokens=40)) == 1.0


@pytest.fixture
def one_thread() -> Iterator[None]:
    # As the bench runs; two threads fight over CI's two shared cores (14 s instead of 0.7 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_the_scripted_shift_moves_the_policy_towards_counting(model: Qwen2ForCausalLM,
                                                               tokenizer: PreTrainedTokenizerFast) -> None:
    assert [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)] == DIGITS
    assert tokenizer.convert_tokens_to_ids("<eos>") == EOS
    prompts = [[1, DIGITS[a], 14, DIGITS[b], 17] for a in range(2) for b in range(2)]  # "<bos>a+b="
    samples = [[DIGITS[a + b], EOS] + [EOS] * 8 for a in range(2) for b in range(2)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = argparse.Namespace(drift_lr=3e-3, drift_steps=6, seed=0)
    v1, info = drifted_policy(model, prompts, samples, EOS, DIGITS, args)
    assert info["loss_last"] < info["loss_first"]
    counted = [list(drift_target(s, EOS, DIGITS).completion) for s in samples]  # type: ignore[union-attr]

    def continuation_logprob(policy: Qwen2ForCausalLM) -> float:
        with torch.no_grad():
            total = 0.0
            for p, c in zip(prompts, counted, strict=True):
                lp = torch.log_softmax(policy(input_ids=torch.tensor([p + c])).logits[0], -1)
                total += float(sum(lp[len(p) + i - 1, c[i]] for i in range(2, len(c))))
        return total / len(prompts)

    assert continuation_logprob(v1) > continuation_logprob(model) + 5.0  # nats per sequence
    moved = drift_distance(model, v1, prompts, counted, temperature=1.0)
    assert moved["kl_v1_v0_after"] > 0.1
    # v0 itself is untouched: the shift trains a copy.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
