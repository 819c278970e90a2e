"""Batched, batch-invariant token logprobs: every sequence is computed in a fixed tensor shape.

Why it exists: deterministic mode needs the generator's recomputed behaviour logprobs and the
trainer's logprobs to be bit-identical. `completion_logprobs(..., deterministic=True)` gets that
by computing every sequence in shapes that depend only on its own lengths, in batches (forwarding
each sequence alone gives such shapes too, at many times the cost:
docs/measurements/deterministic-cost-cpu2-2026-12-07.md). A row's result depends on the reduction
order of the kernels, and on CPU (MKL sgemm, PyTorch's softmax and RMSNorm, eager and SDPA
attention) that order is fixed by the tensor *shape*, not by the other rows' values nor by the
row's position in the batch (`bench/batch_invariance.py` measures this). So each sequence is
placed in a (batch_size, bucket length) tensor whose shape depends only on that sequence's own
length; both sides then run the same kernels on it, in batches.

Why the length is bucketed rather than free: the attention-weights @ values product reduces over
the padded key length, and MKL's blocking of that reduction changes with it once a sequence is
longer than ~128 tokens, so padding the same sequence to 256 or to 272 columns differs in the
last bit. The number of rows is not fixed: from `MIN_ROWS` rows up a row's bits do not depend on
it (`tests/unit/test_exact_decode.py` pins this), and the decoding generator (`exact_decode`)
depends on that anyway, so a fixed batch would only add fill rows.
Deterministic mode attends with `exact_attention` on both sides, the kernel that also makes a
row's result independent of the query length (what lets the generator decode in this layout).

Padding: right padding under causal attention. A real token only attends to earlier positions,
which are real, and the masked scores become exact zeros after softmax, so the pads change
nothing but the (fixed) shape. The attention kernel is pinned (`attn`) for the duration of the
call, so a generator loaded with SDPA and a trainer loaded with eager attention still agree.

Deterministic mode runs `shared_prompt_logprobs`: the same idea in two passes, each distinct
prompt once and then the completions against their prompt's KV, because GRPO groups share a
prompt and forwarding it once per sample doubled the work on short-answer tasks.

Exactness holds for given weights, tokens, dtype, device, library build and the same
`FixedShapes` on both sides; the model's train/eval mode is the caller's (dropout must be 0,
as in every Qwen2 config rlbus builds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from rlbus.services.policy.errors import PolicyError
from rlbus.services.policy.exact_attention import EXACT_ATTN
from rlbus.services.policy.sampling import SamplingParams, processed_logprobs
from rlbus.services.policy.sequences import AttnName, PromptCompletion, attention, check_sequences

K = TypeVar("K", int, tuple[int, int])


class FixedShapesError(PolicyError):
    """A `FixedShapes` setting cannot be used; the message names the field and a valid value."""


@dataclass(frozen=True)
class FixedShapes:
    """The shapes sequences are computed in: `batch_size` rows of `bucket_len(n)` columns.

    `bucket` rounds a sequence of n tokens up to the next multiple of `bucket` columns, capped
    at `max_len` (the model's context) when given.  With `geometric`, the step doubles with the
    length once a sequence spans more than 4 steps (a 100-token sequence rounds to a multiple of
    16, a 500-token one to 64): short sequences pad little, long ones by less than a quarter, and
    the distinct shapes, each a batch that fill rows may waste, are 4 per doubling of the length.
    A batch has `batch_size` rows, or with `fill_to` set, as many rows as it holds sequences (at
    most `batch_size`) filled up to `fill_to`.  Both sides must use equal `FixedShapes`.
    """

    batch_size: int = 8
    bucket: int = 32
    max_len: int | None = None
    geometric: bool = False
    fill_to: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise FixedShapesError(f"batch_size={self.batch_size}: use at least 1 row per batch")
        if self.fill_to is not None and not 1 <= self.fill_to <= self.batch_size:
            raise FixedShapesError(f"fill_to={self.fill_to}: use None or 1 to batch_size={self.batch_size} rows")
        if self.bucket < 1:
            raise FixedShapesError(f"bucket={self.bucket}: use a bucket width of at least 1 token")
        if self.max_len is not None and self.max_len < 1:
            raise FixedShapesError(f"max_len={self.max_len}: use the model's context length or None")

    def bucket_len(self, n_tokens: int) -> int:
        step = self.bucket
        if self.geometric:
            step = max(step, 1 << max(0, (n_tokens - 1).bit_length() - 3))
        width = -(-n_tokens // step) * step
        return width if self.max_len is None else min(width, self.max_len)

    def plan(self, lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
        """(columns, sequence indices) of each batch: sequences grouped by bucket, in input
        order within a bucket, `batch_size` at a time.  A batch holds at most `batch_size`
        indices; the caller fills the rest of its rows with padding."""
        return self._batches([self.bucket_len(n) for n in lengths])

    def plan_pairs(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, int], list[int]]]:
        """Like `plan` for (prompt length, completion length) pairs: a batch shares both buckets."""
        return self._batches([(self.bucket_len(p), self.bucket_len(c)) for p, c in pairs])

    def _batches(self, keys: Sequence[K]) -> list[tuple[K, list[int]]]:
        by_key: dict[K, list[int]] = {}
        for i, key in enumerate(keys):
            by_key.setdefault(key, []).append(i)
        return [(key, idx[s: s + self.batch_size]) for key, idx in sorted(by_key.items())  # type: ignore[type-var]
                for s in range(0, len(idx), self.batch_size)]

    def padded_tokens(self, lengths: Sequence[int]) -> int:
        """Token slots computed for `lengths`, pads and fill rows included (the cost)."""
        return sum(self.rows(len(rows)) * width for width, rows in self.plan(lengths))

    def for_model(self, max_positions: int | None) -> FixedShapes:
        """These shapes with ``max_len`` the model's context (a bucket never passes it)."""
        return replace(self, max_len=max_positions) if max_positions else self

    def rows(self, used: int) -> int:
        """Rows a batch holding `used` sequences is computed with: `batch_size`, or with `fill_to`
        set, `used` filled up to `fill_to`."""
        return self.batch_size if self.fill_to is None else max(used, self.fill_to)


# Fewer rows than this take another matmul path on this CPU (one row differs in the last bit from
# the same row among more; 8 to 4096 rows agree, `tests/unit/test_exact_decode.py`): a batch or a
# decode group with fewer rows is filled up to it.
MIN_ROWS = 8

# The shapes of deterministic mode on both sides (``completion_logprobs(..., deterministic=True)``):
# one constant, so a generator and a trainer cannot disagree.  Rows are not fixed: a row's bits do
# not depend on the number of rows from MIN_ROWS up (the decoding generator relies on the same), so
# each (prompt bucket, completion bucket) is one batch of up to 256 rows, filled only to MIN_ROWS;
# the trainer's micro-batch bounds the memory as in default mode.  A fixed row count would pay for
# fill rows, and coarse length steps for pads (short answers suffer most); with free rows and 1-token
# steps for short sequences the trainer's forward+backward costs about the default path's, and less
# on long answers, which the default path pads to the longest row
# (docs/measurements/deterministic-cost-cpu2-2026-12-07.md).  Geometric steps (1 token up to 8,
# 2 up to 16, 4 up to 32, ...) keep long sequences from multiplying the shapes.
DETERMINISTIC_SHAPES = FixedShapes(batch_size=256, bucket=1, geometric=True, fill_to=MIN_ROWS)


def deterministic_shapes(model: torch.nn.Module) -> FixedShapes:
    """`DETERMINISTIC_SHAPES` capped at `model`'s context: what the trainer's function and the decoding
    generator both compute in (one function, so the two sides cannot pick different shapes).  Refuses a
    model whose shapes break a kernel fact the exactness rests on (``exact_check``)."""
    from rlbus.services.policy.exact_check import require_exact_kernels  # it imports this module

    require_exact_kernels(model)
    return DETERMINISTIC_SHAPES.for_model(getattr(getattr(model, "config", None), "max_position_embeddings", None))


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
    device = _checked_device(model, sequences, shapes)
    out: list[torch.Tensor] = [torch.zeros(0)] * len(sequences)  # plan() covers every index
    lengths = [len(p) + len(c) for p, c in sequences]
    with torch.set_grad_enabled(grad), attention(model, attn):
        for width, rows in shapes.plan(lengths):
            ids = _right_padded([[*sequences[i][0], *sequences[i][1]] for i in rows], shapes.rows(len(rows)), width).to(device)
            # Every position's logits, so the output layer's shape is fixed too.
            logits = model(input_ids=ids, use_cache=False).logits
            logprobs = processed_logprobs(logits, params.temperature, params.top_p)
            for r, i in enumerate(rows):
                prompt, completion = sequences[i]
                start = len(prompt) - 1  # position j predicts token j+1
                targets = ids[r, start + 1: start + 1 + len(completion)].unsqueeze(-1)
                out[i] = logprobs[r, start: start + len(completion)].gather(-1, targets).squeeze(-1)
    return out


def shared_prompt_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[PromptCompletion],
    params: SamplingParams,
    shapes: FixedShapes,
    *,
    attn: AttnName = EXACT_ATTN,
    grad: bool = False,
) -> list[torch.Tensor]:
    """`fixed_shape_logprobs` with each distinct prompt forwarded once (GRPO groups share one).

    Two fixed-shape passes: the distinct prompts, right-padded in (batch_size, prompt bucket)
    tensors, give every prompt its KV and its last position's logits; then the completions, in
    (batch_size, completion bucket) tensors grouped by (prompt bucket, completion bucket), attend
    to their own prompt's KV through an explicit mask that hides the prompt's padding. A
    completion's values depend only on its own prompt and tokens and `shapes`, not on the other
    sequences or on which of them share its prompt, so a generator that groups by sample and a
    trainer that groups by micro-batch get the same bits. They differ from
    `fixed_shape_logprobs`'s in the last bits (other shapes): both sides must call this one.
    """
    device = _checked_device(model, sequences, shapes)
    owner: dict[tuple[int, ...], int] = {}
    owners = [owner.setdefault(tuple(p), len(owner)) for p, _ in sequences]
    out: list[torch.Tensor] = [torch.zeros(0, device=device)] * len(sequences)
    live = [i for i, (_, c) in enumerate(sequences) if len(c)]
    with torch.set_grad_enabled(grad), attention(model, attn):
        prompts = PromptStates.compute(model, list(owner), shapes, device)
        plan = shapes.plan_pairs([(len(sequences[i][0]), len(sequences[i][1])) for i in live])
        for (prompt_width, width), batch in plan:
            rows = [live[b] for b in batch]
            # Fill rows repeat the first row: any valid input, their results are dropped.
            filled = rows + [rows[0]] * (shapes.rows(len(rows)) - len(rows))
            ids = _right_padded([sequences[i][1] for i in filled], len(filled), width)
            prompt_lens = [len(sequences[i][0]) for i in filled]
            positions = torch.tensor(prompt_lens)[:, None] + torch.arange(width)[None, :]
            cache = prompts.cache_for([owners[i] for i in filled], model)
            mask = _completion_mask(prompt_lens, prompt_width, width, prompts.dtype).to(device)
            logits = model(input_ids=ids.to(device), attention_mask=mask, position_ids=positions.to(device),
                           past_key_values=cache, use_cache=True).logits
            # Token 0 is predicted by the prompt's last position, token j by completion position j-1.
            first = torch.stack([prompts.last_logits[owners[i]] for i in filled])
            logprobs = processed_logprobs(torch.cat([first[:, None], logits[:, :-1]], dim=1), params.temperature, params.top_p)
            token_lp = logprobs.gather(-1, ids.to(device).unsqueeze(-1)).squeeze(-1)
            for r, i in enumerate(rows):
                out[i] = token_lp[r, : len(sequences[i][1])]
    return out


def _right_padded(rows: Sequence[Sequence[int]], batch_size: int, width: int) -> torch.Tensor:
    """A (batch_size, width) id tensor holding ``rows`` from the left, the rest pad id 0 (any valid
    id: what the pads compute is hidden from real tokens by causal attention or a mask)."""
    ids = torch.zeros((batch_size, width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(list(row), dtype=torch.long)
    return ids


def _checked_device(model: torch.nn.Module, sequences: Sequence[PromptCompletion], shapes: FixedShapes) -> torch.device:
    config = getattr(model, "config", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    check_sequences(sequences, max_positions, getattr(config, "vocab_size", None))
    if shapes.max_len is not None and max_positions is not None and shapes.max_len > max_positions:
        raise FixedShapesError(f"max_len={shapes.max_len} exceeds the model's max_position_embeddings="
                               f"{max_positions}: set max_len to at most that")
    return next(model.parameters()).device


def _completion_mask(prompt_lens: Sequence[int], prompt_width: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive (rows, 1, width, prompt_width + width) mask: a completion position sees its prompt's
    real tokens and the completion up to itself; the prompt's padding and later positions get the
    dtype's minimum, which softmax turns into exact zeros.  Explicit, so the attention kernel's path
    does not depend on whether any row of the batch happens to be padded."""
    keys = torch.arange(prompt_width + width)
    query = torch.arange(width)[:, None] + prompt_width
    lens = torch.tensor(list(prompt_lens))[:, None, None]
    seen = (keys[None, None, :] < lens) | ((keys[None, None, :] >= prompt_width) & (keys[None, None, :] <= query[None]))
    return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)[:, None]


@dataclass
class PromptStates:
    """Each distinct prompt's per-layer (key, value) and its last position's logits, computed in
    fixed (batch_size, prompt bucket) shapes; rows of one bucket share a width."""

    kv: list[list[tuple[torch.Tensor, torch.Tensor]]]  # [prompt][layer] -> (heads, width, head_dim) each
    last_logits: list[torch.Tensor]
    dtype: torch.dtype

    @classmethod
    def compute(cls, model: torch.nn.Module, prompts: list[tuple[int, ...]], shapes: FixedShapes,
                device: torch.device) -> PromptStates:
        from transformers import DynamicCache

        kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
        last: list[torch.Tensor] = [torch.zeros(0)] * len(prompts)
        for width, rows in shapes.plan([len(p) for p in prompts]):
            # Right padding: causal attention hides the pads from every real prompt token.
            ids = _right_padded([prompts[i] for i in rows], shapes.rows(len(rows)), width)
            fwd = model(input_ids=ids.to(device), past_key_values=DynamicCache(config=model.config), use_cache=True)
            for r, i in enumerate(rows):
                kv[i] = [(layer.keys[r], layer.values[r]) for layer in fwd.past_key_values.layers]
                last[i] = fwd.logits[r, len(prompts[i]) - 1]
        return cls(kv, last, next(model.parameters()).dtype)

    def stacked(self, owners: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (keys, values) of shape (rows, heads, width, head_dim): row r holds the KV of
        prompt ``owners[r]`` (the owners share a prompt bucket, so a width)."""
        return [(torch.stack([self.kv[o][layer][0] for o in owners]), torch.stack([self.kv[o][layer][1] for o in owners]))
                for layer in range(len(self.kv[owners[0]]))]

    def cache_for(self, owners: Sequence[int], model: torch.nn.Module) -> object:
        """A fresh cache holding, row by row, the KV of prompt ``owners[row]``."""
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        for layer, (keys, values) in enumerate(self.stacked(owners)):
            cache.update(keys, values, layer)
        return cache
