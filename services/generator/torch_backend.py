"""PyTorch generator backend: the policy package's GroupSampler behind the Backend interface."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from services.generator.backend import SampleMeter
from services.policy.load import load_policy, load_state_from_safetensors, read_weights
from services.policy.sampler import GroupSampler, MidSequenceSwap
from services.policy.sampling import SamplingParams


class WeightSlot:
    """The live model plus at most one staged version.  ``maybe_swap`` runs in the sampler
    thread between decode steps; ``stage`` runs in the event loop's worker thread."""

    def __init__(self, model: torch.nn.Module, version: int) -> None:
        self.model = model
        self.version = version
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self.swaps = 0
        self.swap_seconds: list[float] = []

    def stage(self, version: int, weights: bytes | memoryview) -> None:
        tensors = read_weights(weights)  # decode outside the sampler's critical path
        with self._lock:
            if version > max(self.version, self._pending[0] if self._pending else -1):
                self._pending = (version, tensors)

    def maybe_swap(self) -> bool:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        t0 = time.perf_counter()
        load_state_from_safetensors(self.model, pending[1])
        self.version = pending[0]
        self.swaps += 1
        self.swap_seconds.append(time.perf_counter() - t0)
        return True


class TorchBackend(SampleMeter):
    def __init__(self, model_path: str, *, dtype: str = "float32", deterministic: bool = False, version: int = 0,
                 slowdown: float = 1.0, mid_sequence_swap: MidSequenceSwap = "when_cheaper", **_: Any) -> None:
        model, tokenizer = load_policy(model_path, dtype=dtype, attn="eager" if deterministic else "sdpa")  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        self.slot = WeightSlot(model, version)
        self.sampler = GroupSampler(self.slot, deterministic=deterministic, mid_sequence_swap=mid_sequence_swap)
        SampleMeter.__init__(self, slowdown)

    @property
    def version(self) -> int:
        return self.slot.version

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                max_new_tokens=sampling.max_new_tokens, stop_token_ids=tuple(stop_ids))
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        return self.metered(lambda: self.sampler.sample_groups(prompts, n, params, gen))

    def stage(self, version: int, weights: bytes | memoryview) -> None:
        self.slot.stage(version, weights)

    def apply_staged(self) -> bool:
        return self.slot.maybe_swap()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def metrics(self) -> dict[str, float]:
        pauses = self.slot.swap_seconds
        return {"generator/swaps": self.slot.swaps,
                "generator/swap_pause_last_s": pauses[-1] if pauses else 0.0,
                "generator/swap_pause_max_s": max(pauses) if pauses else 0.0,
                "generator/sample_seconds": self.sample_seconds,
                "generator/tokens": self.tokens}
