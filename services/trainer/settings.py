"""Settings of the trainer ([trainer] table).  Defaults are the stable ones for the toy task."""

from typing import Literal

from pydantic import Field

from services.runtime.config import Settings


class TrainerSettings(Settings):
    instance: str = Field("trainer-0", description="Instance name (metrics subject token).")
    lr: float = Field(1e-4, gt=0, le=1e-1, description="AdamW learning rate (3e-4 collapsed the tiny policy; 1e-4 is stable).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Training precision of the forward.")
    deterministic: bool = Field(False, description="Batch-invariant logprobs, bit-identical to a deterministic generator's.")
    # objective
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO ratio clip below 1.")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 (clip-higher).")
    correction: Literal["tis", "mis", "seq_reject", "none"] = Field("tis", description="Off-policy correction of behaviour vs trainer.")
    is_cap: float = Field(2.0, gt=0, description="Truncated IS cap.")
    is_low: float = Field(0.5, gt=0, description="Masked IS band, low.")
    is_high: float = Field(2.0, gt=0, description="Masked IS band, high.")
    seq_low: float = Field(0.99, gt=0, description="Sequence rejection: geometric-mean ratio low bound.")
    seq_high: float = Field(1.01, gt=0, description="Sequence rejection: geometric-mean ratio high bound.")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the initial policy (0 = no reference model kept).")
    aggregation: Literal["token_mean", "seq_mean"] = Field("token_mean", description="Loss aggregation.")
    normalize_std: bool = Field(True, description="Divide group advantages by the group std (False = Dr. GRPO).")
    baseline: Literal["mean", "leave_one_out"] = Field("mean", description="Group baseline.")
    micro_batch_seqs: int = Field(256, ge=1, description="Sequences per forward/backward (gradient accumulation).")
    # durability
    checkpoint_every: int = Field(10, ge=1, description="Steps between checkpoints; consumed groups are acked at each checkpoint.")
    checkpoint_keep: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    transport: Literal["objstore", "file"] = Field("objstore", description="Weight transport to weight-broadcast.")
    max_steps: int = Field(0, ge=0, description="Stop after this many optimiser steps (0 = until stopped).")
    ack_wait: float = Field(30.0, gt=1, description="Seconds before an un-acked scored group is redelivered (held ones are heartbeated; a crashed trainer's come back after this).")
    fetch_timeout: float = Field(0.5, gt=0, description="Seconds one pull waits for scored groups.")
    distributed: Literal["auto", "off", "gloo", "nccl"] = Field(
        "auto", description="Data-parallel FSDP2 training under torchrun: 'auto' = on when WORLD_SIZE > 1 (nccl with "
                            "CUDA, else gloo on CPU); 'gloo'/'nccl' force that backend; 'off' = single process.")
