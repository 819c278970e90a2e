"""Fixed-shape logprobs (services/policy/exact.py): a sequence's logprobs are the same bits
whatever else is in its batch, wherever it sits, and with or without autograd in train mode;
and they are the model's logprobs (agree with the ordinary batched forward to float rounding)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rlbus.services.policy.exact import (
    DETERMINISTIC_SHAPES,
    FixedShapes,
    FixedShapesError,
    fixed_shape_logprobs,
    shared_prompt_logprobs,
)
from rlbus.services.policy.logprobs import completion_logprobs
from rlbus.services.policy.sampling import SamplingParams

PARAMS = SamplingParams(temperature=1.0)


def _sequences(seed: int, count: int, max_len: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(3, max_len)
        p = rng.randint(1, n - 1)
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        out.append((ids[:p], ids[p:]))
    return out


@pytest.mark.parametrize("which", ["model", "long_model"])
def test_a_sequence_gets_the_same_bits_whatever_its_neighbours_and_row(which: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(which)
    ctx, vocab = model.config.max_position_embeddings, model.config.vocab_size
    shapes = FixedShapes(batch_size=4, bucket=32, max_len=ctx)
    ours = _sequences(0, 10, ctx, vocab)
    alone = fixed_shape_logprobs(model, ours, PARAMS, shapes)
    # The same sequences shuffled among others: other rows, other neighbours, other batch counts.
    others = _sequences(1, 9, ctx, vocab)
    mixed = [(s, i) for i, s in enumerate(ours)] + [(s, None) for s in others]
    random.Random(2).shuffle(mixed)
    together = fixed_shape_logprobs(model, [s for s, _ in mixed], PARAMS, shapes)
    for (_, i), lp in zip(mixed, together, strict=True):
        if i is not None:
            assert torch.equal(lp, alone[i]), f"sequence {i} changed with its batch"
    # The values are the model's: the ordinary batched forward agrees to float rounding.
    reference = completion_logprobs(model, ours, PARAMS)
    for i, (a, b) in enumerate(zip(alone, reference, strict=True)):
        assert a.shape == (len(ours[i][1]),)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_train_mode_autograd_forward_gives_the_inference_bits(long_model: Qwen2ForCausalLM) -> None:
    ctx, vocab = long_model.config.max_position_embeddings, long_model.config.vocab_size
    shapes = FixedShapes(batch_size=4, bucket=64, max_len=ctx)
    seqs = _sequences(3, 9, ctx, vocab)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    with torch.no_grad():
        inference = fixed_shape_logprobs(long_model, seqs, params, shapes)
    long_model.train()
    try:
        # The trainer's order: its own batch (reversed here), autograd on, train mode.
        trained = fixed_shape_logprobs(long_model, seqs[::-1], params, shapes, grad=True)[::-1]
    finally:
        long_model.eval()
    for i, (a, b) in enumerate(zip(inference, trained, strict=True)):
        assert b.requires_grad
        assert torch.equal(a, b.detach()), f"sequence {i}: train-mode autograd forward differs"
    torch.cat([t[torch.isfinite(t)] for t in trained]).sum().backward()
    assert long_model.lm_head.weight.grad is not None and bool(long_model.lm_head.weight.grad.abs().sum() > 0)
    long_model.zero_grad(set_to_none=True)


def test_eager_and_sdpa_are_each_exact_but_are_different_kernels(long_model: Qwen2ForCausalLM) -> None:
    ctx, vocab = long_model.config.max_position_embeddings, long_model.config.vocab_size
    shapes = FixedShapes(batch_size=4, bucket=64, max_len=ctx)
    seqs = _sequences(4, 6, ctx, vocab)
    previous = long_model.config._attn_implementation
    eager = fixed_shape_logprobs(long_model, seqs, PARAMS, shapes, attn="eager")
    eager_again = fixed_shape_logprobs(long_model, seqs[::-1], PARAMS, shapes, attn="eager")[::-1]
    sdpa = fixed_shape_logprobs(long_model, seqs, PARAMS, shapes, attn="sdpa")
    assert long_model.config._attn_implementation == previous  # pinned only for the call
    assert all(torch.equal(a, b) for a, b in zip(eager, eager_again, strict=True))
    # Both sides must pin the same kernel: the two differ in the last bits.
    assert not all(torch.equal(a, b) for a, b in zip(eager, sdpa, strict=True))


def test_plan_puts_every_sequence_once_in_a_bucket_that_holds_it() -> None:
    shapes = FixedShapes(batch_size=3, bucket=16, max_len=64)
    lengths = [1, 16, 17, 64, 5, 33, 2, 15, 40, 63]
    plan = shapes.plan(lengths)
    seen = sorted(i for _, rows in plan for i in rows)
    assert seen == list(range(len(lengths)))
    for width, rows in plan:
        assert 1 <= len(rows) <= 3 and width % 16 == 0
        assert all(shapes.bucket_len(lengths[i]) == width >= lengths[i] for i in rows)
    assert shapes.padded_tokens(lengths) == sum(3 * w for w, _ in plan)
    assert FixedShapes(bucket=48, max_len=64).bucket_len(50) == 64  # capped at the context


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"bucket": 0}, {"max_len": 0}])
def test_bad_shapes_are_refused_with_the_field_named(kwargs: dict[str, int]) -> None:
    with pytest.raises(FixedShapesError, match=next(iter(kwargs))):
        FixedShapes(**kwargs)


def test_max_len_beyond_the_model_context_is_refused(model: Qwen2ForCausalLM) -> None:
    with pytest.raises(FixedShapesError, match="max_position_embeddings"):
        fixed_shape_logprobs(model, [([1], [2])], PARAMS, FixedShapes(max_len=model.config.max_position_embeddings + 1))


def _groups(seed: int, n_prompts: int, per_prompt: int, max_len: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    """GRPO-shaped input: several completions (some empty) per prompt, mixed lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_prompts):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, max_len // 2))]
        for _ in range(per_prompt):
            out.append((prompt, [rng.randrange(1, vocab) for _ in range(rng.randint(0, max_len - len(prompt)))]))
    return out


@pytest.mark.parametrize("which", ["model", "long_model"])
def test_shared_prompt_path_gives_a_completion_the_same_bits_whoever_shares_its_prompt(
    which: str, request: pytest.FixtureRequest
) -> None:
    model = request.getfixturevalue(which)
    ctx, vocab = model.config.max_position_embeddings, model.config.vocab_size
    shapes = FixedShapes(batch_size=4, bucket=8, max_len=ctx, geometric=True)
    seqs = _groups(5, 5, 4, ctx, vocab)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    with torch.no_grad():
        generator_side = shared_prompt_logprobs(model, seqs, params, shapes)
    # The trainer's view: another order, another subset of each group, autograd on, train mode.
    order = list(range(len(seqs)))
    random.Random(6).shuffle(order)
    subset = order[: len(order) * 2 // 3]
    model.train()
    try:
        trainer_side = shared_prompt_logprobs(model, [seqs[i] for i in subset], params, shapes, grad=True)
    finally:
        model.eval()
    for k, i in enumerate(subset):
        assert torch.equal(trainer_side[k].detach(), generator_side[i]), f"sequence {i} changed with its batch"
    # The values are the model's: the ordinary batched forward agrees to float rounding.
    reference = completion_logprobs(model, seqs, params)
    for i, (a, b) in enumerate(zip(generator_side, reference, strict=True)):
        assert a.shape == (len(seqs[i][1]),)
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"sequence {i}: another top-p nucleus"
        torch.testing.assert_close(a[torch.isfinite(a)], b[torch.isfinite(b)], rtol=0, atol=1e-4)
    live = [t for t in trainer_side if t.numel()]
    torch.cat([t[torch.isfinite(t)] for t in live]).sum().backward()
    assert model.lm_head.weight.grad is not None and bool(model.lm_head.weight.grad.abs().sum() > 0)
    model.zero_grad(set_to_none=True)


def test_deterministic_completion_logprobs_is_the_shared_prompt_path(model: Qwen2ForCausalLM) -> None:
    seqs = _groups(7, 3, 3, model.config.max_position_embeddings, model.config.vocab_size)
    shapes = DETERMINISTIC_SHAPES.for_model(model.config.max_position_embeddings)
    ours = completion_logprobs(model, seqs, PARAMS, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, shared_prompt_logprobs(model, seqs, PARAMS, shapes), strict=True))


def test_geometric_steps_pad_short_sequences_finely_and_long_ones_by_less_than_a_quarter() -> None:
    shapes = FixedShapes(bucket=4, geometric=True)
    assert [shapes.bucket_len(n) for n in (1, 9, 32, 33, 100, 500)] == [4, 12, 32, 40, 112, 512]
    for n in range(1, 2048):
        width = shapes.bucket_len(n)
        assert n <= width < max(n + 4, n * 5 // 4)
    assert len({shapes.bucket_len(n) for n in range(1, 2048)}) <= 4 + 4 * 9  # 4 per doubling past 16
    assert FixedShapes(bucket=4).bucket_len(100) == 100  # linear steps stay as they were
