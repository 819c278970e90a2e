"""PyTorch generator backend: the policy package's GroupSampler behind the Backend interface."""

from __future__ import annotations

import copy
from typing import Any

import torch

from rlbus.schemas.metric_keys import SpeculativeKeys
from rlbus.services.generator.backend import SampleMeter
from rlbus.services.policy.episodes import EpisodeEngine
from rlbus.services.policy.load import load_policy, load_state_from_safetensors
from rlbus.services.policy.sampler import GroupSampler, MidSequenceSwap, StaticSlot
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.policy.spec_tail import Speculation, SpeculationConfig
from rlbus.services.policy.weight_slot import WeightSlot


def _params(sampling: Any, stop_ids: list[int], seed: int) -> tuple[SamplingParams, torch.Generator]:
    params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                            max_new_tokens=sampling.max_new_tokens, stop_token_ids=tuple(stop_ids))
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return params, gen


def _speculation(options: Any, policy: torch.nn.Module) -> Speculation | None:
    """[generator.speculative] (a SpeculativeOptions, a dict, or None) as the sampler's speculative tail;
    a draft model (drafter_names.MODEL_DRAFTERS) is loaded now and checked against the policy."""
    config = SpeculationConfig.of(options)
    return Speculation.build(config, policy) if config.drafter != "off" else None  # type: ignore[arg-type]


class TorchBackend(SampleMeter):
    def __init__(self, model_path: str, *, dtype: str = "float32", deterministic: bool = False, version: int = 0,
                 slowdown: float = 1.0, mid_sequence_swap: MidSequenceSwap = "when_cheaper", pin_eval: bool = False,
                 speculative: Any = None, **_: Any) -> None:
        model, tokenizer = load_policy(model_path, dtype=dtype)
        self.tokenizer = tokenizer
        self.slot = WeightSlot(model, version)
        # The live sampler only: held-out rounds on the pinned copy decode plainly, so drafting
        # never touches what the held-out accuracy measures.
        self.speculation = _speculation(speculative, model)
        self.sampler = GroupSampler(self.slot, deterministic=deterministic, mid_sequence_swap=mid_sequence_swap,
                                    speculation=self.speculation)
        # A second copy that never follows the live weights: held-out rounds sample it at exactly
        # the version they were scheduled at.  Copied now, so it starts at the initial version,
        # which no manifest carries.
        self.pinned: StaticSlot | None = None
        self._pinned_sampler: GroupSampler | None = None
        if pin_eval:
            self.pinned = StaticSlot(copy.deepcopy(model), version)
            self._pinned_sampler = GroupSampler(self.pinned, deterministic=deterministic)
        self._deterministic = deterministic
        self._episodes: EpisodeEngine | None = None
        SampleMeter.__init__(self, slowdown)

    @property
    def version(self) -> int:
        return self.slot.version

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def max_context(self) -> int | None:
        return getattr(self.slot.model.config, "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.slot.model.config, "vocab_size", None)

    def sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        return self.metered(lambda: self.sampler.sample_groups(prompts, n, *_params(sampling, stop_ids, seed)))

    @property
    def pinned_version(self) -> int | None:
        return self.pinned.version if self.pinned is not None else None

    def sample_at(self, version: int, weights: bytes | memoryview | None, prompts: list[list[int]], n: int,
                  sampling: Any, stop_ids: list[int], seed: int) -> list[list[Any]]:
        if self.pinned is None or self._pinned_sampler is None:
            raise RuntimeError("sample_at needs the backend built with pin_eval=True")
        if self.pinned.version != version:
            if weights is None:
                raise ValueError(f"pinned copy holds v{self.pinned.version}; pass the weights of v{version}")
            load_state_from_safetensors(self.pinned.model, weights)
            self.pinned.version = version
        sampler = self._pinned_sampler
        return self.metered(lambda: sampler.sample_groups(prompts, n, *_params(sampling, stop_ids, seed)))

    def episodes(self) -> EpisodeEngine:
        """The backend's one episode engine, on the live weight slot, so staged versions reach its
        rows at its next run (made on first use: a single-turn run never pays for it)."""
        if self._episodes is None:
            self._episodes = EpisodeEngine(self.slot, deterministic=self._deterministic)
        return self._episodes

    def stage(self, version: int, weights: bytes | memoryview) -> None:
        self.slot.stage(version, weights)

    @property
    def draft_version(self) -> int:
        """The draft model's version in the drafting rounds now (0: the draft_model_path folder's;
        -1: no draft model)."""
        draft = self.speculation.draft if self.speculation is not None else None
        return int(draft.version) if draft is not None else -1

    def stage_draft(self, version: int, weights: bytes | memoryview) -> None:
        """A new version of the draft model (drafter "model" / "model+group"); swapped in between target forwards."""
        if self.speculation is None:
            raise RuntimeError("stage_draft needs [generator.speculative] drafter = \"model\" or \"model+group\"")
        self.speculation.stage_draft(version, weights)

    def apply_staged(self) -> bool:
        return self.slot.maybe_swap()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def metrics(self) -> dict[str, float]:
        pauses = self.slot.swap_seconds
        kv = self._episodes.stats if self._episodes is not None else {}
        return {"generator/prefill_tokens": kv.get("prefill_tokens", 0),
                "generator/prefill_reused_tokens": kv.get("reused_tokens", 0),
                "generator/kv_rebuilds": kv.get("rebuilds", 0),
                "generator/swaps": self.slot.swaps,
                "generator/swap_pause_last_s": pauses[-1] if pauses else 0.0,
                "generator/swap_pause_max_s": max(pauses) if pauses else 0.0,
                "generator/sample_seconds": self.sample_seconds,
                # Sampled tokens of both paths: episodes decode in the episode engine, not through metered().
                "generator/tokens": self.tokens + kv.get("decode_tokens", 0),
                **self._speculation_metrics()}

    def _speculation_metrics(self) -> dict[str, float]:
        """The last sampler call's speculative tail (SpeculativeKeys); none while drafting is off."""
        if self.speculation is None:
            return {}
        last = self.speculation.last_call.metrics()
        return {SpeculativeKeys.key(name): value for name, value in last.items()}
