"""Every wire message of rlbus.  Nothing else defines a wire format."""

from rlbus.schemas.base import ArraySpec, Message, SchemaError
from rlbus.schemas.control import (
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
from rlbus.schemas.env import EnvReply, EnvReplyBatch, EnvReset, EnvResetBatch, EnvStep
from rlbus.schemas.rollout import Rollout, RolloutGroup, ScoredGroup, ScoredRollout, spans_from_versions
from rlbus.schemas.task import EpisodeLimits, SamplingParams, Task
from rlbus.schemas.weights import Shard, TensorMeta, WeightManifest

ALL_MESSAGES: tuple[type[Message], ...] = (
    SamplingParams, EpisodeLimits, Task, Rollout, RolloutGroup, ScoredRollout, ScoredGroup, TensorMeta, Shard,
    WeightManifest, Admit, AssignPools, Concurrency, Evaluate, RunState, SetMix, Stall, Divergence, Control, Heartbeat,
    DeadLetter, EnvReset, EnvStep, EnvReply, EnvResetBatch, EnvReplyBatch,
)

__all__ = [m.__name__ for m in ALL_MESSAGES] + [
    "ArraySpec", "Decision", "DecisionClock", "Message", "SchemaError", "spans_from_versions",
]
