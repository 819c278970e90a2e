"""Settings of the trainer: the ``[trainer]`` table and its nested ``[trainer.objective]`` and
``[trainer.advantages]`` tables.  Defaults are the stable ones for the toy task.

The two nested tables are the very classes the maths uses (``objective.ObjectiveConfig``,
``advantages.AdvantageConfig``): one definition of each knob, its bounds and its documentation,
checked when the config is read, not at the first training step.
"""

import dataclasses
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from rlbus.services.runtime.config import Settings
from rlbus.services.trainer.advantages import AdvantageConfig
from rlbus.services.trainer.objective import ObjectiveConfig

# Keys that were flat in [trainer] before the nested tables existed: old name -> its table now.
MOVED_KEYS: dict[str, str] = {
    **{f.name: "objective" for f in dataclasses.fields(ObjectiveConfig)},
    **{f.name: "advantages" for f in dataclasses.fields(AdvantageConfig)},
}


class TrainerSettings(Settings):
    instance: str = Field("trainer-0", description="Instance name (metrics subject token).")
    lr: float = Field(1e-4, gt=0, le=1e-1, description="AdamW learning rate (3e-4 collapsed the tiny policy; 1e-4 is stable).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description=(
        "Precision the weights are held (and stepped) in. bfloat16 weights lose updates smaller than 1/256 of a "
        "weight, most of them at RL learning rates: prefer float32 weights with autocast = \"bfloat16\"."))
    autocast: Literal["off", "bfloat16"] = Field("off", description=(
        "Mixed precision of the forward/backward: 'bfloat16' runs matmuls in bf16 over float32 master weights "
        "(several times faster on CPUs with bf16 units; the trainer's logprobs then differ from a float32 "
        "generator's by bf16 rounding, which mismatch/* reports); 'off' = the weights' dtype throughout."))
    deterministic: bool = Field(False, description="Batch-invariant logprobs, bit-identical to a deterministic generator's.")
    objective: ObjectiveConfig = Field(
        default_factory=ObjectiveConfig,
        description="[trainer.objective] table: PPO clip, off-policy correction (tis/mis/seq_reject/none) and its "
                    "bounds, KL to the initial policy, loss aggregation (services/trainer/objective.py).")
    advantages: AdvantageConfig = Field(
        default_factory=AdvantageConfig,
        description="[trainer.advantages] table: the group baseline and std normalisation of advantages "
                    "(services/trainer/advantages.py).")
    micro_batch_seqs: int = Field(256, ge=1, description="Sequences per forward/backward (gradient accumulation).")
    # durability
    checkpoint_every: int = Field(10, ge=1, description="Steps between checkpoints; each acks the groups the checkpoint before it covers (acks lag one checkpoint, so a damaged newest one loses nothing): the trainer holds up to two intervals of groups un-acked.")
    checkpoint_keep: int = Field(2, ge=1, description="Checkpoints kept on disk (never fewer than 2: a damaged newest one falls back to the one before).")
    transport: Literal["objstore", "file"] = Field("objstore", description="Weight transport to weight-broadcast.")
    max_steps: int = Field(0, ge=0, description="Stop after this many optimiser steps (0 = until stopped).")
    ack_wait: float = Field(30.0, gt=1, description="Seconds before an un-acked scored group is redelivered (the bus heartbeats held ones; a crashed trainer's come back after this).")
    fetch_timeout: float = Field(0.5, gt=0, description="Seconds one pull waits for scored groups.")
    distributed: Literal["auto", "off", "gloo", "nccl"] = Field(
        "auto", description="Data-parallel FSDP2 training under torchrun: 'auto' = on when WORLD_SIZE > 1 (nccl with "
                            "CUDA, else gloo on CPU); 'gloo'/'nccl' force that backend; 'off' = single process.")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """An old flat key (``[trainer] is_cap``) would otherwise be reported as merely unknown."""
        if not isinstance(data, dict):
            return data
        moved = [k for k in data if k in MOVED_KEYS]
        if moved:
            where = "; ".join(f"'{k}' moved to [trainer.{MOVED_KEYS[k]}] {k}: write it under a "
                              f"[trainer.{MOVED_KEYS[k]}] table (environment: RLBUS_TRAINER__"
                              f"{MOVED_KEYS[k].upper()}__{k.upper()})" for k in moved)
            raise PydanticCustomError("moved_key", "{where}", {"where": where})
        return data
