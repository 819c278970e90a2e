"""Batched, batch-invariant token logprobs: every sequence is computed in a fixed tensor shape.

Why it exists: deterministic mode needs the generator's recomputed behaviour logprobs and the
trainer's logprobs to be bit-identical. `completion_logprobs(..., deterministic=True)` gets that
by forwarding each sequence alone, which costs 16-28x. A row's result depends on the reduction
order of the kernels, and on CPU (MKL sgemm, PyTorch's softmax and RMSNorm, eager and SDPA
attention) that order is fixed by the tensor *shape*, not by the other rows' values nor by the
row's position in the batch (`bench/batch_invariance.py` measures this). So each sequence is
placed in a (batch_size, bucket length) tensor whose shape depends only on that sequence's own
length; both sides then run the same kernels on it, in batches.

Why the length is bucketed rather than free: the attention-weights @ values product reduces over
the padded key length, and MKL's blocking of that reduction changes with it once a sequence is
longer than ~128 tokens, so padding the same sequence to 256 or to 272 columns differs in the
last bit. The batch size is fixed too (short batches are filled with pad rows): the row
results measured here did not depend on it, but a BLAS may pick another kernel for another M,
and a fixed shape rules that out at a bounded cost.

Padding: right padding under causal attention. A real token only attends to earlier positions,
which are real, and the masked scores become exact zeros after softmax, so the pads change
nothing but the (fixed) shape. The attention kernel is pinned (`attn`) for the duration of the
call, so a generator loaded with SDPA and a trainer loaded with eager attention still agree.

Exactness holds for given weights, tokens, dtype, device, library build and the same
`FixedShapes` on both sides; the model's train/eval mode is the caller's (dropout must be 0,
as in every Qwen2 config rlbus builds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.policy.errors import PolicyError
from services.policy.sampling import SamplingParams, processed_logprobs
from services.policy.sequences import AttnName, PromptCompletion, attention, check_sequences


class FixedShapesError(PolicyError):
    """A `FixedShapes` setting cannot be used; the message names the field and a valid value."""


@dataclass(frozen=True)
class FixedShapes:
    """The shapes sequences are computed in: `batch_size` rows of `bucket_len(n)` columns.

    `bucket` rounds a sequence of n tokens up to the next multiple of `bucket` columns, capped
    at `max_len` (the model's context) when given.  Both sides must use equal `FixedShapes`.
    """

    batch_size: int = 8
    bucket: int = 32
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise FixedShapesError(f"batch_size={self.batch_size}: use at least 1 row per batch")
        if self.bucket < 1:
            raise FixedShapesError(f"bucket={self.bucket}: use a bucket width of at least 1 token")
        if self.max_len is not None and self.max_len < 1:
            raise FixedShapesError(f"max_len={self.max_len}: use the model's context length or None")

    def bucket_len(self, n_tokens: int) -> int:
        width = -(-n_tokens // self.bucket) * self.bucket
        return width if self.max_len is None else min(width, self.max_len)

    def plan(self, lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
        """(columns, sequence indices) of each batch: sequences grouped by bucket, in input
        order within a bucket, `batch_size` at a time.  A batch holds at most `batch_size`
        indices; the caller fills the rest of its rows with padding."""
        by_width: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            by_width.setdefault(self.bucket_len(n), []).append(i)
        return [(width, idx[s: s + self.batch_size]) for width, idx in sorted(by_width.items())
                for s in range(0, len(idx), self.batch_size)]

    def padded_tokens(self, lengths: Sequence[int]) -> int:
        """Token slots computed for `lengths`, pads and fill rows included (the cost)."""
        return sum(self.batch_size * width for width, _ in self.plan(lengths))

    def for_model(self, max_positions: int | None) -> FixedShapes:
        """These shapes with ``max_len`` the model's context (a bucket never passes it)."""
        return FixedShapes(self.batch_size, self.bucket, max_positions) if max_positions else self


# The shapes of deterministic mode on both sides (``completion_logprobs(..., deterministic=True)``):
# one constant, so a generator and a trainer cannot disagree.  16-token buckets keep the padding of
# short completions small (the addition task's sequences are 15-20 tokens); 8 rows a batch.
DETERMINISTIC_SHAPES = FixedShapes(batch_size=8, bucket=16)


def fixed_shape_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[PromptCompletion],
    params: SamplingParams,
    shapes: FixedShapes,
    *,
    attn: AttnName = "sdpa",
    grad: bool = False,
) -> list[torch.Tensor]:
    """Log-prob of each completion token under `processed_logprobs(params)`, one float32
    tensor of shape (len(completion),) per pair, computed in `shapes`; with a graph when `grad`.

    The result for a pair depends only on the pair, the weights and `shapes`/`attn`: not on the
    other pairs, their order, or whether autograd is on.
    """
    config = getattr(model, "config", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    check_sequences(sequences, max_positions, getattr(config, "vocab_size", None))
    if shapes.max_len is not None and max_positions is not None and shapes.max_len > max_positions:
        raise FixedShapesError(f"max_len={shapes.max_len} exceeds the model's max_position_embeddings="
                               f"{max_positions}: set max_len to at most that")
    device = next(model.parameters()).device
    out: list[torch.Tensor] = [torch.zeros(0)] * len(sequences)  # plan() covers every index
    lengths = [len(p) + len(c) for p, c in sequences]
    with torch.set_grad_enabled(grad), attention(model, attn):
        for width, rows in shapes.plan(lengths):
            # Pad id 0 is any valid id: causal attention hides pads from every real token.
            ids = torch.zeros((shapes.batch_size, width), dtype=torch.long)
            for r, i in enumerate(rows):
                prompt, completion = sequences[i]
                ids[r, : lengths[i]] = torch.tensor([*prompt, *completion], dtype=torch.long)
            ids = ids.to(device)
            # Every position's logits, so the output layer's shape is fixed too.
            logits = model(input_ids=ids, use_cache=False).logits
            logprobs = processed_logprobs(logits, params.temperature, params.top_p)
            for r, i in enumerate(rows):
                prompt, completion = sequences[i]
                start = len(prompt) - 1  # position j predicts token j+1
                targets = ids[r, start + 1: start + 1 + len(completion)].unsqueeze(-1)
                out[i] = logprobs[r, start: start + len(completion)].gather(-1, targets).squeeze(-1)
    return out
