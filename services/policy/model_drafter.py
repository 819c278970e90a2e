"""The `model` / `static` drafter: a small draft model samples the next k tokens of each tail row.

Why sampling and not the draft's argmax: `accept_drafts` keeps the target's distribution for any
proposal q as long as it is told q, and it keeps the most tokens when q is close to p. Sampling
the draft's *processed* distribution (the target's temperature and top-p) makes q as close to p
as the draft can be; the k distributions go to the acceptance rule with the drafted ids.

Context: recomputed every round. Each round prefills the draft over every tail row's whole
sequence (prompt and completion so far, left-padded) and then decodes k - 1 more tokens on that
fresh cache. Keeping a per-row draft cache across rounds would save the prefill, but it would
have to be cropped after every rejection and rebuilt after every draft swap and tail-row exit,
on this CPU the prefill is cheap: a 1-layer draft of the tiny policy took 1.7 ms over 1 row of
50 tokens vs 1.4 ms for a one-token step on a cache (2.2 vs 1.6 ms at 2 rows; one thread, machine
shared), so a round with k = 4 costs 1.7 + 3 x 1.4 = 5.9 ms instead of 4 x 1.4 = 5.6 ms, ~5%
more drafting time and far less than the verify forward. A swapped-in draft version is then used
from the very next round with nothing to rebuild.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from rlbus.services.policy.sampling import SamplingParams, processed_logprobs

if TYPE_CHECKING:
    from rlbus.services.policy.sampler import ModelSlot


@dataclass
class ModelDrafts:
    """One round's proposals: `ids[i]` for tail row i (len <= its room) and the distributions
    they were drawn from, [rows, width, vocab] (width = the longest proposal; padded rows' extra
    positions are never read by the acceptance rule)."""

    ids: list[list[int]]
    probs: torch.Tensor


class ModelDrafter:
    """Proposes tokens for the tail's rows from the draft model in `slot` (module docstring)."""

    def __init__(self, slot: ModelSlot) -> None:
        self.slot = slot

    def propose(self, contexts: Sequence[torch.Tensor], rooms: Sequence[int], params: SamplingParams,
                generator: torch.Generator) -> ModelDrafts:
        """Up to `rooms[i]` tokens after `contexts[i]` (a row's prompt and completion so far)."""
        width = max(rooms, default=0)
        model = self.slot.model
        device = contexts[0].device if contexts else torch.device("cpu")
        vocab = int(model.config.vocab_size)
        if width == 0:
            return ModelDrafts([[] for _ in rooms], torch.zeros((len(rooms), 0, vocab), device=device))
        longest = max(len(c) for c in contexts)
        ids = torch.zeros((len(contexts), longest), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, c in enumerate(contexts):
            ids[i, longest - len(c):] = c
            mask[i, longest - len(c):] = 1
        dense = bool(mask.all())
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        fwd = model(input_ids=ids, attention_mask=None if dense else mask, position_ids=positions,
                    past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
        next_pos = positions[:, -1] + 1
        drawn, dists = [], []
        for j in range(width):
            lp = processed_logprobs(fwd.logits[:, -1], params.temperature, params.top_p)
            tok = self._draw(lp, params, generator, device)
            drawn.append(tok)
            dists.append(lp.exp())
            if j + 1 == width:
                break
            if not dense:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            fwd = model(input_ids=tok[:, None], attention_mask=None if dense else mask,
                        position_ids=next_pos[:, None] + j, past_key_values=fwd.past_key_values, use_cache=True)
        tokens = torch.stack(drawn, 1).tolist()
        return ModelDrafts([tokens[i][:room] for i, room in enumerate(rooms)], torch.stack(dists, 1))

    @staticmethod
    def _draw(lp: torch.Tensor, params: SamplingParams, generator: torch.Generator,
              device: torch.device) -> torch.Tensor:
        if params.temperature == 0.0:
            return lp.argmax(dim=-1)
        return torch.multinomial(lp.exp().to(generator.device), 1, generator=generator).squeeze(-1).to(device)
