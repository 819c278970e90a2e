"""The attention kernel of deterministic mode, whose row results do not depend on the query length.

Why it exists: for the generator's behaviour log-probs to be bit-identical to the trainer's, the
generator could sample and then recompute every sample in the trainer's fixed shapes, but that
costs as much as the sampling itself on short answers
(docs/measurements/deterministic-cost-cpu2-2026-12-07.md). Decoding one token per step *is*
already in a shape the trainer's batched forward agrees with, except for attention: measured on
this CPU (torch 2.13, `tests/unit/test_exact_attention.py` keeps checking it),

- the linear layers, norms and softmaxes give a row the same bits whatever the number of rows
  (from 8 rows up; one row takes another matmul path);
- SDPA gives a query the same bits for any query length from 4 up, but another at 1-3 (a decode
  step has one query per row);
- SDPA gives the same bits for any key width that is a multiple of 16 and covers the real keys,
  with the padding masked, up to 192 keys; widths that are not multiples of 16 each differ, and
  above 192 some widths form classes of their own;
- masked key blocks of 16 inserted between the prompt and the completion change nothing.

So this kernel pads the query to at least `MIN_QUERY` rows and the keys to a multiple of
`KEY_BLOCK`, always with an explicit additive mask, and calls SDPA. Both sides run it: the
trainer's fixed-shape forward (`exact.shared_prompt_logprobs`) and the sampler's decode
(`exact_decode`), so a decoded token's log-prob is the trainer's, bit for bit, while the whole
sequence stays within `DECODE_EXACT_KEYS` keys. Longer sequences are recomputed in the trainer's
shapes instead (exact by construction: the same function).

Registered with transformers under `EXACT_ATTN` at import; `sequences.attention(model, "exact")`
switches a model to it for one call.
"""

from __future__ import annotations

from typing import Any, Final

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

EXACT_ATTN: Final = "exact"
MIN_QUERY = 4
KEY_BLOCK = 16
# Up to this many key positions (prompt region + completion) every multiple-of-16 key width gives
# the same bits (measured above); a decoded sequence longer than this is recomputed.
DECODE_EXACT_KEYS = 192


def key_width(n_keys: int) -> int:
    """Keys are padded to a multiple of `KEY_BLOCK`."""
    return -(-n_keys // KEY_BLOCK) * KEY_BLOCK


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **_: Any) -> tuple[torch.Tensor, None]:
    """SDPA on (batch, heads, L, d) queries with at least `MIN_QUERY` query rows and keys padded to
    `key_width`; returns (batch, L, heads, d) like transformers' own kernels.

    `attention_mask` is additive (batch or 1, 1, L or 1, keys) with the dtype's minimum where a
    key is hidden (transformers' eager mask, or the caller's own); None means causal.  Dropout is
    refused: it would make the result random, and every model rlbus builds has none."""
    if dropout:
        raise ValueError(f"dropout={dropout}: deterministic mode needs attention_dropout = 0 in the model config")
    batch, _, length, _ = query.shape
    keys = key.shape[2]
    lowest = torch.finfo(query.dtype).min
    if attention_mask is None:
        seen = torch.arange(keys, device=query.device)[None, :] <= torch.arange(length, device=query.device)[:, None] + (keys - length)
        attention_mask = torch.zeros((1, 1, length, keys), dtype=query.dtype, device=query.device).masked_fill(~seen, lowest)
    rows, width = max(length, MIN_QUERY), key_width(keys)
    mask = attention_mask[..., :keys].to(query.dtype)
    if mask.shape[2] == 1:
        mask = mask.expand(batch, 1, rows, mask.shape[3])
    else:
        # Extra query rows see everything: any finite values, their outputs are dropped.
        mask = F.pad(mask.expand(batch, 1, length, mask.shape[3]), (0, 0, 0, rows - length))
    # Keys past the mask's width (a decode buffer's unwritten columns) and the padding are hidden.
    mask = F.pad(mask, (0, width - mask.shape[3]), value=lowest)
    if width != keys:
        key, value = F.pad(key, (0, 0, 0, width - keys)), F.pad(value, (0, 0, 0, width - keys))
    out = F.scaled_dot_product_attention(
        F.pad(query, (0, 0, 0, rows - length)) if rows != length else query, key, value,
        attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out[:, :, :length].transpose(1, 2).contiguous(), None


AttentionInterface.register(EXACT_ATTN, exact_attention)
AttentionMaskInterface.register(EXACT_ATTN, eager_mask)
