"""Rollouts: sampled trajectories with behaviour logprobs and per-token policy versions.

A group (the ``group_size`` samples of one task) is the unit on the wire: group-relative
advantages need every member, so a partial group is useless to the trainer and would otherwise
have to be reassembled across redeliveries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rlbus.schemas.base import ArraySpec, Message, array_field, invalid
from rlbus.schemas.task import SamplingParams, Task

I32 = array_field(ArraySpec("<i4"))
I64_SPANS = array_field(ArraySpec("<i8", ndim=2))
U8 = array_field(ArraySpec("|u1"))
F32 = array_field(ArraySpec("<f4", finite=True))


def _empty(dtype: str, ndim: int = 1) -> np.ndarray:
    return np.zeros((0,) * ndim if ndim == 1 else (0, 2), dtype=dtype)


@dataclass(frozen=True)
class Rollout(Message):
    """One trajectory.  ``token_ids`` = prompt + completion; arrays after the prompt are per
    completion token: ``loss_mask`` (1 = policy-sampled, 0 = environment-inserted),
    ``behaviour_logprobs`` (of the distribution actually sampled from; 0 where mask is 0) and
    ``version_spans`` (rows of [first completion-token offset, policy version], run-length)."""

    KIND = "rollout"
    rollout_id: str
    task_id: str
    index: int
    token_ids: I32
    prompt_len: int
    loss_mask: U8 = field(default_factory=lambda: _empty("|u1"))
    behaviour_logprobs: F32 = field(default_factory=lambda: _empty("<f4"))
    version_spans: I64_SPANS = field(default_factory=lambda: _empty("<i8", 2))
    finish_reason: str = "stop"  # one of rlbus.schemas.env.EPISODE_ENDS
    text: str = ""  # decoded completion, for verifiers and humans
    generator_id: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    turns: int = 1  # policy turns in the episode
    env_error: str = ""  # an environment failure ended the episode: excluded from the loss, never rewarded 0
    # Deterministic mode: behaviour_logprobs are the batch-invariant values of exactly this (prompt,
    # completion) under the one version of its tokens, so a deterministic trainer at that version
    # reproduces them bit for bit.  False for sampled values and for what recompute cannot cover
    # (tokens spanning a swap, a completion cut after sampling, turns after an episode's first).
    exact_logprobs: bool = False

    def validate(self) -> None:
        n = len(self.token_ids) - self.prompt_len
        if self.prompt_len < 1 or n < 0:
            raise invalid(self, "prompt_len", "must be in [1, len(token_ids)]", got=str(self.prompt_len))
        for name in ("loss_mask", "behaviour_logprobs"):
            if len(getattr(self, name)) != n:
                raise invalid(self, name, "must have one entry per completion token",
                              expected=str(n), got=str(len(getattr(self, name))))
        spans = self.version_spans
        if spans.ndim != 2 or spans.shape[1] != 2:
            raise invalid(self, "version_spans", "must be rows of [offset, version]",
                          expected="shape (k, 2)", got=str(spans.shape))
        rows = spans.tolist()  # a handful of rows: plain Python beats a numpy call per check
        if n and (not rows or rows[0][0] != 0):
            raise invalid(self, "version_spans", "must start at offset 0 when there are completion tokens")
        if any(a[0] >= b[0] for a, b in zip(rows, rows[1:], strict=False)):
            raise invalid(self, "version_spans", "offsets must be strictly increasing")
        if any(v < 0 for _, v in rows):
            raise invalid(self, "version_spans", "versions must be >= 0")

    @property
    def completion_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def token_versions(self) -> np.ndarray:
        """Expand the spans to one version per completion token."""
        n = self.completion_len
        out = np.empty(n, dtype=np.int64)
        spans = self.version_spans
        for i, (start, version) in enumerate(spans):
            end = spans[i + 1, 0] if i + 1 < len(spans) else n
            out[start:end] = version
        return out

    @property
    def oldest_version(self) -> int:
        return int(self.version_spans[:, 1].min()) if len(self.version_spans) else -1

    @property
    def newest_version(self) -> int:
        return int(self.version_spans[:, 1].max()) if len(self.version_spans) else -1


def spans_from_versions(versions: np.ndarray) -> np.ndarray:
    """Run-length encode one-version-per-token into [offset, version] rows."""
    v = np.asarray(versions, dtype=np.int64)
    if v.size == 0:
        return _empty("<i8", 2)
    starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    return np.stack([starts.astype(np.int64), v[starts]], axis=1).astype("<i8")


@dataclass(frozen=True)
class RolloutGroup(Message):
    """All samples of one task, as produced by one generator."""

    KIND = "rollout_group"
    task: Task
    rollouts: list[Rollout]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator_id: str = ""
    created_at: float = 0.0
    task_published_at: float = 0.0

    def validate(self) -> None:
        if not self.rollouts:
            raise invalid(self, "rollouts", "a group needs at least one rollout")
        if any(r.task_id != self.task.task_id for r in self.rollouts):
            raise invalid(self, "rollouts", "every rollout must carry the group's task_id")

    @property
    def group_id(self) -> str:
        return self.task.task_id

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id`` on ROLLOUTS: a generator that re-samples a redelivered task stores one group."""
        return f"rollouts.{self.task.task_id}"


@dataclass(frozen=True)
class ScoredRollout(Message):
    """A rollout with its reward.  ``verifier_error`` set means excluded, not scored 0."""

    KIND = "scored_rollout"
    rollout: Rollout
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    verifier_detail: str = ""
    env_failure: bool = False
    verifier_error: str = ""

    def validate(self) -> None:
        if not math.isfinite(self.reward):  # a NaN reward would make its whole group's advantages NaN
            raise invalid(self, "reward", "must be finite", got=str(self.reward))

    @property
    def valid(self) -> bool:
        return not self.verifier_error and not self.env_failure


@dataclass(frozen=True)
class ScoredGroup(Message):
    KIND = "scored_group"
    task: Task
    scored: list[ScoredRollout]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator_id: str = ""
    created_at: float = 0.0
    scored_at: float = 0.0

    def validate(self) -> None:
        if not self.scored:
            raise invalid(self, "scored", "a scored group needs at least one rollout")

    @property
    def msg_id(self) -> str:
        """Its ``Nats-Msg-Id`` on SCORED: a group scored twice (a redelivered rollout group) is stored once."""
        return f"scored.{self.task.task_id}"
