"""Every wire message of rlbus.  Nothing else defines a wire format."""

from schemas.base import ArraySpec, Message, SchemaError
from schemas.control import (
    Admit,
    AssignPools,
    Concurrency,
    Control,
    DeadLetter,
    Decision,
    DecisionClock,
    Divergence,
    Evaluate,
    Heartbeat,
    RunState,
    SetMix,
    Stall,
)
from schemas.env import EnvReply, EnvReplyBatch, EnvReset, EnvResetBatch, EnvStep
from schemas.rollout import Rollout, RolloutGroup, ScoredGroup, ScoredRollout, spans_from_versions
from schemas.task import EpisodeLimits, SamplingParams, Task
from schemas.weights import Shard, TensorMeta, WeightManifest

ALL_MESSAGES: tuple[type[Message], ...] = (
    SamplingParams, EpisodeLimits, Task, Rollout, RolloutGroup, ScoredRollout, ScoredGroup, TensorMeta, Shard,
    WeightManifest, Admit, AssignPools, Concurrency, Evaluate, RunState, SetMix, Stall, Divergence, Control, Heartbeat,
    DeadLetter, EnvReset, EnvStep, EnvReply, EnvResetBatch, EnvReplyBatch,
)

__all__ = [m.__name__ for m in ALL_MESSAGES] + [
    "ArraySpec", "Decision", "DecisionClock", "Message", "SchemaError", "spans_from_versions",
]
