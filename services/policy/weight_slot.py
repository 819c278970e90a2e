"""A model slot whose weights are replaced in place by staged versions (the generator's live
policy, and the `model` drafter's draft).

Why it is its own module: the generator's backend and the speculative tail's draft both hold a
model that new versions reach while a sampler is using it; staging (decode, check) runs off the
sampler's thread and the copy happens only when the sampler asks, between forwards.
"""

from __future__ import annotations

import threading
import time

import torch
from transformers import PreTrainedModel

from rlbus.services.policy.load import WeightSource, check_weights, copy_weights, read_weights


class WeightSlot:
    """The live model plus at most one staged version.  ``maybe_swap`` runs in the sampler
    thread between decode steps; ``stage`` runs in the event loop's worker thread."""

    def __init__(self, model: PreTrainedModel, version: int) -> None:
        self.model = model
        self.version = version
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self.swaps = 0
        self.swap_seconds: list[float] = []

    def _newest(self) -> int:
        with self._lock:
            return max(self.version, self._pending[0] if self._pending else -1)

    def stage(self, version: int, weights: WeightSource) -> None:
        """Decode and check outside the sampler's critical path.  A version that does not fit the
        model raises ``WeightMismatchError`` here and is never staged: were it found out at the swap,
        in the sampler thread, it would fail a batch (or kill an idle generator, and again on every
        restart, since the newest manifest is replayed on join)."""
        if version <= self._newest():
            return
        tensors = read_weights(weights)
        check_weights(self.model, tensors)
        with self._lock:
            if version > max(self.version, self._pending[0] if self._pending else -1):
                self._pending = (version, tensors)

    def maybe_swap(self) -> bool:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        t0 = time.perf_counter()
        copy_weights(self.model, pending[1])  # checked when staged
        self.version = pending[0]
        self.swaps += 1
        self.swap_seconds.append(time.perf_counter() - t0)
        return True
