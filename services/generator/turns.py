"""Episode turns on any backend's ``sample``: the episode engine's interface for the vLLM backend.

The PyTorch backend has its own ``EpisodeEngine`` (services/policy/episodes.py: rows with their KV
cache, a few decode steps per run).  A backend that batches on its own, as vLLM does with its
continuous batching, needs less: each run hands every turn in progress to ``Backend.sample`` with
the row's whole token sequence as the prompt, one call per sampling setting, and the turns come back
finished.  The backend's prefix cache (vLLM's ``enable_prefix_caching``) holds the KV of the part
of a row it has already seen, so only the observation and the last turn are new work; its hit rate
is on the heartbeat (``generator/prefix_cache_hit_rate``).  The token ids are never re-tokenised:
the rows hold ids, and the prompt given to the backend is those ids.

The difference from the PyTorch engine: a run lasts until its longest turn ends (vLLM streams the
batch to the end), so a new episode joins at the next run rather than within a few tokens; episodes
waiting on tools still hold nobody, since only turns in progress go into a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from rlbus.services.policy.episodes import EpisodeInputError, Turn


@dataclass
class _TurnAsked:
    params: Any  # temperature, top_p
    stop_ids: tuple[int, ...]
    max_new_tokens: int


class SampledTurns:
    """``EpisodeEngine``'s interface (open, append, start_turn, run, truncate, close, tokens, room,
    stats) over a backend's ``sample`` (see the module docstring).  One thread calls it at a time."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._rows: dict[str, list[int]] = {}
        self._turns: dict[str, _TurnAsked] = {}
        self._stats = {"prompt_tokens": 0, "decode_tokens": 0, "calls": 0}

    def _row(self, key: str) -> list[int]:
        if key not in self._rows:
            raise EpisodeInputError(f"no open episode row {key!r}: open it first (closed rows are gone)")
        return self._rows[key]

    def room(self, key: str) -> int | None:
        context = getattr(self.backend, "max_context", None)
        return None if context is None else context - len(self._row(key))

    def open(self, keys: list[str], prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise EpisodeInputError("empty prompt: encode it with a leading <bos>")
        taken = [k for k in keys if k in self._rows]
        if taken or len(set(keys)) != len(keys):
            raise EpisodeInputError(f"episode keys {taken or keys} are already open or repeated: use fresh keys")
        for key in keys:
            self._rows[key] = list(prompt_ids)

    def append(self, key: str, ids: list[int]) -> None:
        if key in self._turns:
            raise EpisodeInputError(f"row {key!r} has a turn in progress: append after it finishes")
        vocab = getattr(self.backend, "vocab_size", None)
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise EpisodeInputError(f"observation for {key!r} has token id {bad[0]} outside the vocabulary "
                                    f"(size {vocab}): encode it with the policy's own tokenizer")
        room = self.room(key)
        if room is not None and len(ids) > room:
            raise EpisodeInputError(f"row {key!r} holds {len(self._rows[key])} tokens; {len(ids)} more would exceed "
                                    "the model's context: end the episode (context limit)")
        self._row(key).extend(int(t) for t in ids)

    def start_turn(self, key: str, params: Any, stop_ids: list[int], max_new_tokens: int, *,
                   final: bool = False) -> None:
        room = self.room(key)
        if room is not None and room < 1:
            raise EpisodeInputError(f"row {key!r} fills the model's context: end the episode (context limit)")
        cap = max_new_tokens if room is None else min(max_new_tokens, room)
        self._turns[key] = _TurnAsked(params, tuple(stop_ids), max(cap, 1))

    def truncate(self, key: str, length: int) -> None:
        row = self._row(key)
        if key in self._turns or not 1 <= length <= len(row):
            raise EpisodeInputError(f"row {key!r} ({len(row)} tokens, turn in progress: {key in self._turns}) "
                                    f"cannot keep {length}")
        del row[length:]

    def close(self, key: str) -> None:
        self._rows.pop(key, None)
        self._turns.pop(key, None)

    def tokens(self, key: str) -> list[int]:
        return list(self._row(key))

    @property
    def stats(self) -> dict[str, float]:
        return {**self._stats, "rows": len(self._rows)}

    def run(self, generator: torch.Generator, max_steps: int = 16) -> list[tuple[str, Turn]]:
        """Every turn in progress, sampled to its end (``max_steps`` does not apply: the backend
        batches the turns itself); one backend call per sampling setting."""
        by_setting: dict[tuple[float, float, int, tuple[int, ...]], list[str]] = {}
        for key, asked in self._turns.items():
            setting = (asked.params.temperature, asked.params.top_p, asked.max_new_tokens, asked.stop_ids)
            by_setting.setdefault(setting, []).append(key)
        finished: list[tuple[str, Turn]] = []
        for (temperature, top_p, max_new, stop_ids), keys in by_setting.items():
            sampling = SimpleNamespace(temperature=temperature, top_p=top_p, max_new_tokens=max_new, stop=[])
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
            prompts = [self._rows[k] for k in keys]
            outs = self.backend.sample(prompts, 1, sampling, list(stop_ids), seed)
            self._stats["calls"] += 1
            self._stats["prompt_tokens"] += sum(len(p) for p in prompts)
            for key, (s,) in zip(keys, outs, strict=True):
                ids = [int(t) for t in s.completion_ids]
                self._rows[key].extend(ids)
                self._stats["decode_tokens"] += len(ids)
                finished.append((key, Turn(ids=ids, logprobs=np.asarray(s.behaviour_logprobs, dtype=np.float32),
                                           versions=np.asarray(s.token_versions, dtype=np.int64),
                                           finish_reason=s.finish_reason)))
            for key in keys:
                del self._turns[key]
        return finished
