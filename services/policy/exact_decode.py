"""Decoding in the trainer's layout: each token's log-prob is the trainer's, without a recompute.

Why it exists: sampling in the fast left-padded layout and then recomputing every sample with the
trainer's function costs, on short answers, as much again as the sampling
(`bench/deterministic_cost.py`, docs/measurements/deterministic-cost-cpu2-2026-12-07.md). The
trainer's function (`exact.shared_prompt_logprobs`) computes a sequence as its prompt,
right-padded to its prompt bucket, then its completion against that prompt's KV. Decoding token by
token in exactly that key layout, with the attention kernel of `exact_attention` (whose results do
not depend on the query length or on masked key padding), gives every decoded token the trainer's
bits: the prompt pass is the trainer's own call, and each later position sees the same keys at the
same indices.

`DecodeGroup` holds the rows of prompts that share a prompt bucket (their keys line up); the
sampler steps all groups together so that weight swaps happen at one step for every row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlbus.services.policy.exact import MIN_ROWS, FixedShapes, PromptStates
from rlbus.services.policy.exact_attention import DECODE_EXACT_KEYS, key_width


class DecodeGroup:
    """The rows of prompts with one prompt bucket (`width`), `n` rows per prompt, their KV cache
    and additive mask in the trainer's layout: prompt columns (its padding hidden), then the
    completion so far."""

    def __init__(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], n: int, width: int,
                 max_new_tokens: int, shapes: FixedShapes, device: torch.device) -> None:
        self.prompts = [tuple(p) for p in prompts]
        self.n = n
        self.width = width
        self.max_new_tokens = max_new_tokens
        self.shapes = shapes
        self.device = device
        self.rows = len(self.prompts) * n
        self.logits = self._start(model)

    def _start(self, model: torch.nn.Module) -> torch.Tensor:
        """Prompt KV under `model` (the trainer's own prompt pass) and the first token's logits."""
        states = PromptStates.compute(model, self.prompts, self.shapes, self.device)
        owners = [i for i in range(len(self.prompts)) for _ in range(self.n)]
        owners += [0] * max(0, MIN_ROWS - len(owners))
        self.cache = KeyBuffer(states.stacked(owners), self.width + self.max_new_tokens)
        lens = torch.tensor([len(self.prompts[o]) for o in owners], device=self.device)
        hidden = torch.arange(self.width, device=self.device)[None, :] >= lens[:, None]
        self.mask = torch.zeros(hidden.shape, dtype=states.dtype, device=self.device).masked_fill(
            hidden, torch.finfo(states.dtype).min)
        self.next_pos = lens
        return torch.stack([states.last_logits[o] for o in owners])[: self.rows]

    def restart(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Rebuild under new weights: the prompts' pass, then the `tokens` decoded so far (rows, t)
        in one forward; returns the logits for the next token."""
        self._start(model)
        return self.extend(model, tokens)

    def extend(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Append `tokens` (rows, m) to every row and return the logits after the last of them."""
        filled = len(self.next_pos)
        ids = torch.zeros((filled, tokens.shape[1]), dtype=torch.long, device=self.device)
        ids[: self.rows] = tokens
        m = ids.shape[1]
        seen = torch.zeros((m, m), dtype=self.mask.dtype, device=self.device).masked_fill(
            ~torch.ones((m, m), dtype=torch.bool, device=self.device).tril(), torch.finfo(self.mask.dtype).min)
        mask = torch.cat([self.mask[:, None, :].expand(-1, m, -1), seen.expand(filled, m, m)], dim=2)[:, None]
        positions = self.next_pos[:, None] + torch.arange(m, device=self.device)[None, :]
        fwd = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache, use_cache=True)
        self.cache.advance(m)
        self.mask = torch.cat([self.mask, torch.zeros((filled, m), dtype=self.mask.dtype, device=self.device)], dim=1)
        self.next_pos = self.next_pos + m
        return fwd.logits[: self.rows, -1]

    def covers(self, completion_len: int) -> bool:
        """Whether a completion of this length decoded here has the trainer's bits: its keys stay
        where every padded key width gives the same result (`DECODE_EXACT_KEYS`)."""
        return key_width(self.width + self.shapes.bucket_len(completion_len)) <= DECODE_EXACT_KEYS


class KeyBuffer:
    """The decode rows' KV cache: per layer, keys and values in buffers of a fixed capacity.

    A forward writes its new columns in place, and attention gets the columns up to the next
    multiple of `KEY_BLOCK` (the unwritten ones are zeros its mask hides), so the kernel neither
    pads nor copies, where a growing cache would copy every column at every step.  Only
    `update` is asked of a cache when the caller passes positions and a 4-D mask, as
    `DecodeGroup.extend` does."""

    def __init__(self, prompt_kv: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> None:
        keys, _ = prompt_kv[0]
        rows, heads, self.length, dim = keys.shape
        capacity = key_width(capacity)
        self.layers = []
        for k, v in prompt_kv:
            kb, vb = k.new_zeros((rows, heads, capacity, dim)), v.new_zeros((rows, heads, capacity, dim))
            kb[:, :, : self.length], vb[:, :, : self.length] = k, v
            self.layers.append((kb, vb))

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + keys.shape[2]
        kb, vb = self.layers[layer]
        kb[:, :, self.length: end], vb[:, :, self.length: end] = keys, values
        seen = min(key_width(end), kb.shape[2])
        return kb[:, :, :seen], vb[:, :, :seen]

    def advance(self, columns: int) -> None:
        """The forward that wrote `columns` new columns into every layer is done."""
        self.length += columns
