"""Deterministic mode checks, for each model shape, the kernel facts it rests on, before it promises anything.

Bit-identical log-probs between generator and trainer rest on properties of this machine's kernels
(``exact_attention``'s docstring lists them): a linear layer gives a row the same bits from
``MIN_ROWS`` rows up, and one SDPA query gets the bits of a block of queries for any key width that is
a multiple of ``KEY_BLOCK`` up to ``DECODE_EXACT_KEYS`` keys.  They were measured for one shape; a
model with other widths (another head_dim, grouped-query attention, a larger vocabulary) may take
other kernel paths.  So both sides check them on random data of the model's own shapes the first
time they meet that shape, and refuse deterministic mode with the fact that failed, instead of
reporting a nonzero mismatch that was promised to be zero.  Measured: the tiny Qwen2 policy and
SmolLM2-135M (head_dim 64, 9 query and 3 key-value heads) both pass on this CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from rlbus.services.policy.errors import PolicyError
from rlbus.services.policy.exact import MIN_ROWS
from rlbus.services.policy.exact_attention import DECODE_EXACT_KEYS, KEY_BLOCK, exact_attention


class DeterministicUnsupported(PolicyError):
    """Deterministic mode cannot be exact for this model on this machine; the message names the fact."""


@dataclass(frozen=True)
class ModelShape:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        return cls(heads=heads, kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=head_dim, hidden=hidden, intermediate=int(getattr(config, "intermediate_size", hidden * 4)),
                   vocab=int(config.vocab_size))


class _Groups(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


@lru_cache(maxsize=8)
def violations(shape: ModelShape, dtype: torch.dtype = torch.float32, threads: int = 1) -> tuple[str, ...]:
    """The kernel facts that do not hold for ``shape`` here, with ``threads`` intra-op threads (the
    caller's; kernels split rows across threads, so the facts depend on it); empty: exact."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _violations(shape, dtype)
    finally:
        torch.set_num_threads(before)


def _violations(shape: ModelShape, dtype: torch.dtype) -> tuple[str, ...]:
    g = torch.Generator().manual_seed(0)
    found: list[str] = []
    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for k, n in ((shape.hidden, q_width), (shape.hidden, kv_width), (shape.hidden, shape.intermediate),
                 (shape.intermediate, shape.hidden), (shape.hidden, min(shape.vocab, 8192))):
        w, x = torch.randn(n, k, generator=g, dtype=dtype), torch.randn(256, k, generator=g, dtype=dtype)
        full = F.linear(x, w)
        for rows in (MIN_ROWS, 9, 31):
            if not torch.equal(F.linear(x[:rows], w), full[:rows]):
                found.append(f"a {k}->{n} linear layer gives {rows} rows other bits than 256 rows")
                break
    q = torch.randn(2, shape.heads, 40, shape.head_dim, generator=g, dtype=dtype)
    kv = [torch.randn(2, shape.kv_heads, DECODE_EXACT_KEYS, shape.head_dim, generator=g, dtype=dtype) for _ in "kv"]
    groups = _Groups(shape.heads // shape.kv_heads)
    lowest = torch.finfo(dtype).min
    for real in (17, 40, DECODE_EXACT_KEYS - 3):
        block, _ = exact_attention(groups, q, kv[0][:, :, :real], kv[1][:, :, :real], None)
        for i in (0, 39):
            seen = real - 40 + i + 1
            if seen < 1:
                continue
            for width in sorted({-(-seen // KEY_BLOCK) * KEY_BLOCK, DECODE_EXACT_KEYS}):
                mask = torch.zeros(1, 1, 1, width, dtype=dtype).masked_fill(torch.arange(width) >= seen, lowest)
                one, _ = exact_attention(groups, q[:, :, i: i + 1], kv[0][:, :, :width], kv[1][:, :, :width], mask)
                if not torch.equal(one[:, 0], block[:, i]):
                    found.append(f"one attention query over {width} padded keys ({seen} real) gets other bits than "
                                 f"in a 40-query block (head_dim {shape.head_dim}, {shape.heads}/{shape.kv_heads} heads)")
    return tuple(dict.fromkeys(found))


def require_exact_kernels(model: torch.nn.Module) -> None:
    """Raise ``DeterministicUnsupported`` when deterministic mode cannot be exact for ``model`` here."""
    config = getattr(model, "config", None)
    if config is None:
        return  # a bare module in a test: its caller checks its own shapes
    threads = torch.get_num_threads()
    found = violations(ModelShape.of(config), next(model.parameters()).dtype, threads)
    if found:
        raise DeterministicUnsupported("deterministic mode cannot be exact for this model on this machine: "
                                       + "; ".join(found) + f" (with {threads} torch threads). Turn deterministic off "
                                       "(the mismatch metrics then report the gap), use one thread per process, or run "
                                       "on a machine whose kernels keep these facts")
