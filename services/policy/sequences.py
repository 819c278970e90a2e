"""What every log-prob function takes: (prompt, completion) pairs, checked before any forward, and
the attention kernel pinned for a call.

Why a module of its own: the default batched path (``logprobs``) and the fixed-shape
deterministic path (``exact``) both need it, and ``logprobs`` dispatches to ``exact``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch

from rlbus.services.policy import exact_attention  # noqa: F401  (registers the "exact" kernel)
from rlbus.services.policy.errors import PolicyError

# "exact": services/policy/exact_attention.py, registered with transformers when imported.
AttnName = Literal["sdpa", "eager", "exact"]

PromptCompletion = tuple[Sequence[int], Sequence[int]]


class LogprobInputError(PolicyError):
    """A (prompt, completion) pair cannot be scored; the message names which one and why."""


@contextmanager
def attention(model: torch.nn.Module, attn: AttnName) -> Iterator[None]:
    """Run the block with attention implementation ``attn``, then restore the model's own.

    Both sides of an exactness claim must run the same kernel (SDPA and eager attention differ in
    the last bits).  Not thread-safe: one process drives one model, as everywhere in rlbus."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if config is None or previous in (None, attn):
        yield
        return
    model.set_attn_implementation(attn)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_attn_implementation(previous)  # type: ignore[operator]


def outside_vocab(ids: Sequence[int], vocab_size: int | None) -> int | None:
    """The first token id outside ``[0, vocab_size)`` (a negative id always is), or None: the check
    the sampler, the episode engine and the scoring functions each run on what they are handed."""
    return next((int(t) for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)


def check_sequences(sequences: Sequence[PromptCompletion], max_positions: int | None, vocab_size: int | None) -> None:
    """Raise `LogprobInputError` for the first pair the model cannot score: a token id outside
    ``[0, vocab_size)``, an empty prompt, or more than ``max_positions`` tokens.  Every scoring
    function runs it first; a caller may run it to find which of its inputs a failure came from."""
    for i, (prompt, completion) in enumerate(sequences):
        if (bad := outside_vocab([*prompt, *completion], vocab_size)) is not None:
            raise LogprobInputError(
                f"sequence {i} has token id {bad} outside the vocabulary (size {vocab_size}): "
                "was it produced by a different tokenizer?"
            )
        if len(prompt) == 0:
            raise LogprobInputError(
                f"sequence {i} has an empty prompt: prepend <bos> so the first completion "
                "token has a position that predicts it"
            )
        total = len(prompt) + len(completion)
        if max_positions is not None and total > max_positions:
            raise LogprobInputError(
                f"sequence {i} has {total} tokens, more than the model's "
                f"max_position_embeddings={max_positions}: shorten max_new_tokens or the prompt"
            )
