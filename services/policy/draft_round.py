"""One verify round's proposals from possibly two drafters (drafter "model+group" / "static+group").

Why mix per row: the group drafter's suffix match costs no forward and, when it hits, is often
long (repeated text, a sibling's answer); the draft model proposes something everywhere but costs
its forwards. So each row takes the group's proposal when there is one and the draft model's
otherwise, and only the rows without a match pay for the draft model.

Exactness: `accept_drafts` needs the distribution q each drafted token was drawn from. A group
proposal is deterministic, a point mass, so its row in `probs` is one-hot: min(1, p/q) is then
p(x), and the residual max(p - q, 0) is p with x removed, exactly what the point-mass path
(draft_probs=None) computes. The whole mixed batch goes through `accept_drafts` once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from rlbus.services.policy.model_drafter import ModelDrafts

Source = Literal["group", "model"]


@dataclass
class RoundDrafts:
    """`ids[i]`: tail row i's proposal; `sources[i]`: which drafter made it (None: no draft);
    `probs`: [rows, width, vocab] the distributions they were drawn from, or None when every
    proposal is a point mass (no draft model row this round)."""

    ids: list[list[int]]
    sources: list[Source | None]
    probs: torch.Tensor | None

    @classmethod
    def of_group(cls, group: Sequence[list[int]]) -> RoundDrafts:
        return cls([list(g) for g in group], ["group" if g else None for g in group], None)

    @classmethod
    def mixed(cls, group: Sequence[list[int]], model_rows: Sequence[int], model: ModelDrafts) -> RoundDrafts:
        """Rows in `model_rows` take `model`'s proposals (aligned with `model_rows`), every other
        row its `group` proposal as a one-hot distribution."""
        if len(model_rows) == len(group):  # every row the model's ("model", "static"): its tensor as drawn, no copy
            return cls([list(d) for d in model.ids], ["model" if d else None for d in model.ids], model.probs)
        ids = [list(g) for g in group]
        sources: list[Source | None] = ["group" if g else None for g in group]
        for m, row in enumerate(model_rows):
            ids[row] = list(model.ids[m])
            sources[row] = "model" if model.ids[m] else None
        width = max((len(d) for d in ids), default=0)
        vocab = model.probs.shape[-1]
        probs = torch.zeros((len(ids), width, vocab), dtype=model.probs.dtype, device=model.probs.device)
        taken = min(width, model.probs.shape[1])
        if model_rows and taken:
            rows = torch.tensor(list(model_rows), dtype=torch.long, device=probs.device)
            probs[rows, :taken] = model.probs[:, :taken]
        for row, source in enumerate(sources):
            if source == "group":
                at = torch.arange(len(ids[row]), device=probs.device)
                probs[row, at, torch.tensor(ids[row], dtype=torch.long, device=probs.device)] = 1.0
        return cls(ids, sources, probs)
