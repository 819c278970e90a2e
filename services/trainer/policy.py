"""The policy being trained: model, optimiser, frozen reference and the step that updates them.

In one process, or sharded with FSDP2 over the ranks of a torchrun job (``distributed.py``):
then this process is rank 0, and ``model`` / ``optimizer`` are stand-ins that gather or scatter
the full state over every rank, which is all that checkpoints and the weight hand-over use of
them (``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from rlbus.services.policy.load import load_policy
from rlbus.services.runtime.config import RunSettings
from rlbus.services.trainer import distributed
from rlbus.services.trainer.judge import InputLimits
from rlbus.services.trainer.settings import TrainerSettings
from rlbus.services.trainer.step import PackedSeq, make_optimizer, train_step


class TrainedPolicy:
    def __init__(self, model: Any, optimizer: Any, step: Callable[[list[PackedSeq]], dict[str, float]],
                 sharded: distributed.ShardedPolicy | None, limits: InputLimits | None = None) -> None:
        self.model: torch.nn.Module = model  # or the sharded policy's view of it
        # What the model can score, read from the model itself (a sharded view has no config).
        self.limits = limits if limits is not None else InputLimits.of_model(model)
        self.optimizer: torch.optim.Optimizer = optimizer  # or the sharded policy's view of it
        self._step = step
        self._sharded = sharded

    @classmethod
    async def load(cls, run_cfg: RunSettings, cfg: TrainerSettings) -> TrainedPolicy | None:
        """The initial policy from ``[run] model_path``.  None on a rank > 0 of a torchrun job, once
        it has followed rank 0's steps and state gathers until rank 0 stopped it."""
        # Deterministic mode pins its own attention kernel for every forward it makes (exact_attention).
        model, _ = await asyncio.to_thread(load_policy, run_cfg.model_path, dtype=cfg.dtype)
        ref_model = copy.deepcopy(model).eval() if cfg.objective.kl_coef > 0 else None
        limits = InputLimits.of_model(model)
        if distributed.backend_for(cfg.distributed) is None:
            optimizer = make_optimizer(model, cfg)
            return cls(model, optimizer, functools.partial(train_step, model, optimizer, cfg=cfg, ref_model=ref_model),
                       None, limits)
        sharded = await asyncio.to_thread(distributed.ShardedPolicy.join, model, cfg, ref_model)
        if sharded.rank > 0:
            await asyncio.to_thread(sharded.follow)
            return None
        return cls(sharded.model_view, sharded.optimizer_view, sharded.train_step, sharded, limits)

    def train_step(self, seqs: list[PackedSeq]) -> dict[str, float]:
        """One optimiser step on a packed batch; blocks (run it in a worker thread).  Metrics."""
        return self._step(seqs)

    async def close(self) -> None:
        """Release the follower ranks, if any.  Safe to call twice."""
        if self._sharded is not None:
            await asyncio.to_thread(self._sharded.close)
