"""Data-parallel training of the policy across torchrun ranks, sharded with FSDP2.

Shape: rank 0 is the trainer service (bus I/O, batch assembly, checkpoints, weight hand-over,
acks); ranks > 0 only *follow*: they wait for rank 0's next command on a CPU side channel and
take part in what it needs every rank for.  Commands, all issued by rank 0 in one order:

  step           the packed batch is broadcast; each rank trains on its contiguous slice
  model_state    full (unsharded) weights gathered to rank 0, for the weight hand-over and checkpoints
  optimizer_state  full AdamW state gathered to rank 0, in the single-process layout
  load_model / load_optimizer  a checkpoint read by rank 0, scattered to every rank's shard
  stop           rank 0 is done: followers leave the process group and return

Exact equality with the single-process step: ``policy_loss`` already normalises by the token
(or sequence) count of the *whole* batch, passed in, so the losses of any split of the batch
sum to the full-batch loss.  Each rank therefore uses the whole-batch counts on its own slice,
and FSDP reduces gradients with a plain SUM (divide factor 1) instead of its default mean:
the summed gradient is the single-process gradient, up to float summation order.  Clipping
then sees the norm of that full gradient (``clip_grad_norm_`` all-reduces over the DTensor
shards), every rank makes the same skip decision on a non-finite norm, and AdamW steps each
rank's shard.

Ragged work: ranks run different numbers of forwards (shared-prefix groups, parameter groups,
micro-batches, or no sequence at all), so no collective may depend on the data.  A step
therefore all-gathers every FSDP unit once up front, runs the local forwards/backwards with
gradient sync off (gradients accumulate unsharded), then one zero-loss forward/backward of a
single token, identical on every rank, carries the reduce-scatter of the accumulated
gradients; then the parameters are resharded.  The cost: during a step each rank holds the
full parameters and its full local gradients (as DDP does); the optimiser state is always
sharded, and parameters and gradients are between steps.

The side channel pickles (``broadcast_object_list``): it connects the ranks of one job, which
trust each other; it is not a wire format between services.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from rlbus.observability.logging import get_logger
from rlbus.services.policy.logprobs import check_sequences
from rlbus.services.trainer.errors import TrainerError
from rlbus.services.trainer.judge import InputLimits
from rlbus.services.trainer.settings import TrainerSettings
from rlbus.services.trainer.step import PackedSeq, accumulate, batch_counts, make_optimizer, step_metrics

log = get_logger()

# Followers block on the side channel while rank 0 waits for a batch, which has no bound (the
# generators may be slow or paused).  A dead rank is torchrun's to detect: it ends the job.
_FOLLOW_TIMEOUT = timedelta(days=7)
_JOINED: list[bool] = []  # non-empty once this process joined a torchrun job (``leave_job``)
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


class DistributedTrainerError(TrainerError):
    """The distributed trainer cannot start or was used wrongly; the message says how to fix it."""


def backend_for(setting: str, env: Mapping[str, str] = os.environ) -> str | None:
    """The process-group backend for ``[trainer] distributed``, or None for a single process."""
    world = int(env.get("WORLD_SIZE", "1"))
    if setting == "off" or (setting == "auto" and world <= 1):
        return None
    if "RANK" not in env or "MASTER_ADDR" not in env:
        raise DistributedTrainerError(f"[trainer] distributed = {setting!r} needs torchrun's environment (RANK, "
                                      "WORLD_SIZE, MASTER_ADDR, MASTER_PORT): start with `torchrun --nproc-per-node N "
                                      "--no-python rlbus serve trainer --config …`, or set distributed = 'off'")
    if setting == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if setting == "nccl" and not torch.cuda.is_available():
        raise DistributedTrainerError("[trainer] distributed = 'nccl' needs CUDA, which this process does not see: "
                                      "use 'gloo' (CPU) or 'auto'")
    return setting


def leave_job(code: int = 0) -> None:
    """End the process now if it joined a torchrun job here: flush, then ``os._exit``.

    Why: after a clean stop (every rank left the process group) a rank was seen once in CI, among
    many clean runs, to die of SIGABRT ("terminate called without an active exception"), and
    torchrun then fails the whole job.  C++ threads and objects of the process group outlive
    ``destroy_process_group`` (modules and device meshes keep references) and are torn down at
    interpreter exit in an order nothing controls.  By the time this is called the process has
    closed what it owns, so skipping finalisation loses nothing.  A no-op outside a job."""
    if not _JOINED:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def rank_slices(lengths: list[int], world: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` sequence ranges, one per rank, balanced by token count.  Every
    sequence lands on exactly one rank, whole; a rank may get none (a tiny batch)."""
    cum = list(itertools.accumulate(lengths, initial=0))
    cuts = [0]
    for r in range(1, world):
        target = cum[-1] * r / world
        i = bisect.bisect_left(cum, target)
        if i > 0 and (i == len(cum) or target - cum[i - 1] < cum[i] - target):
            i -= 1
        cuts.append(min(max(i, cuts[-1]), len(lengths)))
    cuts.append(len(lengths))
    return list(itertools.pairwise(cuts))


def _units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules to shard one by one: the model's own repeated blocks (what a Hugging
    Face model lists in ``_no_split_modules``, e.g. Qwen2DecoderLayer)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


@dataclass(frozen=True)
class _Ranks:
    rank: int
    world: int
    device: torch.device


class ShardedPolicy:
    """The policy and its AdamW optimiser sharded over every rank; rank 0 leads, the others follow."""

    def __init__(self, model: torch.nn.Module, cfg: TrainerSettings, ref_model: torch.nn.Module | None,
                 ranks: _Ranks) -> None:
        self.cfg, self.ref_model, self.ranks = cfg, ref_model, ranks
        mesh = init_device_mesh(ranks.device.type, (ranks.world,))
        # Parameters stay unsharded from the explicit all-gather at the start of a step to its end
        # (see the module docstring), so forwards never reshard.
        for unit in _units(model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        self.model = model
        self._limits = InputLimits.of_model(model)  # what the forwards of a step check (logprobs.py)
        self._fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in self._fsdp:
            # Each rank's loss is already its share of the whole-batch loss: sum, do not average.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
        self.optimizer = make_optimizer(model, cfg)
        names = {p: n for n, p in model.named_parameters()}
        self._param_names = [names[p] for g in self.optimizer.param_groups for p in g["params"]]
        self._commands = dist.new_group(backend="gloo", timeout=_FOLLOW_TIMEOUT)
        self._ops: dict[str, Callable[[Any, Any], Any]] = {
            "step": self._step, "model_state": self._model_state, "optimizer_state": self._optimizer_state,
            "load_model": self._load_model, "load_optimizer": self._load_optimizer}
        self._lock = threading.Lock()
        self._closed = False
        self._broken = False
        self.model_view = _ModelView(self)
        self.optimizer_view = _OptimizerView(self)

    @classmethod
    def join(cls, model: torch.nn.Module, cfg: TrainerSettings, ref_model: torch.nn.Module | None = None,
             *, backend: str | None = None) -> ShardedPolicy:
        """Join torchrun's process group and shard ``model`` (the same weights on every rank)."""
        backend = backend or backend_for(cfg.distributed)
        if backend is None:
            raise DistributedTrainerError("distributed training is off here (WORLD_SIZE <= 1 and distributed = "
                                          f"{cfg.distributed!r}): use train_step, or run under torchrun")
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
        _JOINED.append(True)
        model.to(device)
        if ref_model is not None:
            ref_model.to(device)
        ranks = _Ranks(dist.get_rank(), dist.get_world_size(), device)
        log.info("distributed_trainer", rank=ranks.rank, world=ranks.world, backend=backend, device=str(device),
                 units=len(_units(model)))
        return cls(model, cfg, ref_model, ranks)

    @property
    def rank(self) -> int:
        return self.ranks.rank

    # ---- rank 0 -------------------------------------------------------------------------------

    def train_step(self, seqs: list[PackedSeq]) -> dict[str, float]:
        """One optimiser step on the whole batch, spread over every rank; whole-batch metrics.

        Raises ``LogprobInputError`` for a batch the model cannot score, before any rank is
        involved: the check every rank's forward would run on its slice, run here on the whole
        batch.  A rank raising it mid-step would leave the others waiting in a collective (the
        job then hangs or dies); refused here, nothing has started, and the trainer refuses the
        groups at fault as in one process and goes on with the next batch."""
        check_sequences([(s.prompt, s.completion) for s in seqs], self._limits.max_positions,
                        self._limits.vocab_size)
        t0 = time.perf_counter()
        metrics: dict[str, float] = self._lead("step", seqs)
        metrics["train/step_s"] = time.perf_counter() - t0  # the batch broadcast included
        return metrics

    def close(self) -> None:
        """Release the followers and leave the process group.  Safe to call twice.  After a failed
        command the followers may be stuck in a collective: then exiting (torchrun ends the job)
        is the way out, not another message."""
        if self._closed or self.rank != 0:
            return
        self._closed = True
        if not self._broken:
            with self._lock:
                dist.broadcast_object_list(["stop", None], src=0, group=self._commands)
                # Every rank has the stop before any tears its connections down.
                dist.barrier(group=self._commands)
            dist.destroy_process_group()

    def _lead(self, op: str, payload: Any = None, local: Any = None) -> Any:
        if self.rank != 0:
            raise DistributedTrainerError(f"rank {self.rank} called {op!r}: only rank 0 leads; the others follow()")
        if self._closed or self._broken:
            raise DistributedTrainerError(f"{op!r} after the distributed trainer was closed or failed")
        with self._lock:
            try:
                dist.broadcast_object_list([op, payload], src=0, group=self._commands)
                return self._ops[op](payload, local)
            except BaseException:
                self._broken = True
                raise

    # ---- ranks > 0 ----------------------------------------------------------------------------

    def follow(self) -> None:
        """Run rank 0's commands until it stops.  An error ends this process (torchrun then ends the job)."""
        while True:
            box: list[Any] = [None, None]
            dist.broadcast_object_list(box, src=0, group=self._commands)
            op, payload = box
            if op == "stop":
                dist.barrier(group=self._commands)
                break
            self._ops[op](payload, None)
        dist.destroy_process_group()
        log.info("distributed_follower_stopped", rank=self.rank)

    # ---- every rank ---------------------------------------------------------------------------

    def _step(self, seqs: list[PackedSeq], _: Any) -> dict[str, float] | None:
        t0 = time.perf_counter()
        cfg, model = self.cfg, self.model
        n_tokens_total, n_seqs_total = batch_counts(seqs)
        lo, hi = rank_slices([len(s.prompt) + len(s.completion) for s in seqs], self.ranks.world)[self.rank]
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for m in self._fsdp:
            m.unshard()
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        model.set_reshard_after_backward(False)  # type: ignore[operator]
        totals: dict[str, float] = {}
        trainer_lps: list[torch.Tensor] = []
        if hi > lo:
            totals, trainer_lps = accumulate(model, seqs[lo:hi], cfg, self.ref_model, n_tokens_total=n_tokens_total,
                                             n_seqs_total=n_seqs_total)
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
        model.set_reshard_after_backward(True)  # type: ignore[operator]
        self._reduce_gradients()
        for m in self._fsdp:
            m.reshard()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if math.isfinite(grad_norm):  # the same full-gradient norm on every rank: the same decision
            self.optimizer.step()
        model.eval()
        local = (totals, torch.cat(trainer_lps).cpu() if trainer_lps else torch.zeros(0))
        gathered: list[Any] | None = [None] * self.ranks.world if self.rank == 0 else None
        dist.gather_object(local, gathered, dst=0, group=self._commands)
        if gathered is None:
            return None
        summed: dict[str, float] = {}
        for rank_totals, _lp in gathered:
            for k, v in rank_totals.items():
                summed[k] = summed.get(k, 0.0) + v
        # Slices are contiguous and in rank order, so this is every token of the batch in order.
        trainer_lp = torch.cat([lp for _totals, lp in gathered])
        return step_metrics(seqs, summed, trainer_lp, grad_norm, cfg, t0)

    def _reduce_gradients(self) -> None:
        """One zero-loss forward/backward of a single token, the same on every rank: its backward
        reduce-scatters (sums) the gradients each rank accumulated locally, whatever its work was."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.ranks.device)
        logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        (logits.float().sum() * 0.0).backward()

    def _model_state(self, _: Any, __: Any) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=_FULL)

    def _optimizer_state(self, _: Any, __: Any) -> dict[str, Any]:
        named: dict[str, Any] = get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)  # type: ignore[assignment]
        if self.rank != 0:
            return {}
        # Hyper-parameters are the same on every rank, and the local state_dict() already lists
        # them in the positional layout; only the per-parameter state needs the full gather.
        index = {n: i for i, n in enumerate(self._param_names)}
        return {"state": {index[n]: st for n, st in named["state"].items()},
                "param_groups": self.optimizer.state_dict()["param_groups"]}

    def _load_model(self, _: Any, state: dict[str, Any] | None) -> None:
        set_model_state_dict(self.model, state or {}, options=_FROM_RANK0)

    def _load_optimizer(self, _: Any, state: dict[str, Any] | None) -> None:
        named = _named(state, self._param_names) if state else {}
        tuples = [{k for k, v in g.items() if isinstance(v, tuple)} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, named, options=_FROM_RANK0)
        for group, keys in zip(self.optimizer.param_groups, tuples, strict=True):
            for k in keys:  # the broadcast turns tuples (betas) into lists; keep what a single process keeps
                group[k] = tuple(group[k])


def _named(indexed: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A checkpoint's optimiser state (``optimizer.state_dict()`` layout, keyed by position) keyed
    by parameter name, as torch.distributed loads it: checkpoints move between 1 and N ranks."""
    return {"state": {names[int(i)]: s for i, s in indexed["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in indexed["param_groups"]]}


class _ModelView:
    """What ``checkpoint`` and ``weights_bytes`` use of a model, across ranks (on rank 0)."""

    def __init__(self, policy: ShardedPolicy) -> None:
        self._policy = policy
        self._keys = list(policy.model.state_dict())  # sharded: names only, no communication

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._policy._lead("model_state")  # type: ignore[no-any-return]

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        # Checked before any rank is involved, so a wrong checkpoint fails here, cleanly.
        missing, unexpected = sorted(set(self._keys) - set(state)), sorted(set(state) - set(self._keys))
        if strict and (missing or unexpected):
            raise DistributedTrainerError(f"checkpoint does not fit the model: missing {missing[:3]}, "
                                          f"unexpected {unexpected[:3]}: was it saved from another architecture?")
        self._policy._lead("load_model", local=dict(state))


class _OptimizerView:
    """What ``checkpoint`` uses of an optimiser, across ranks (on rank 0), in the single-process layout."""

    def __init__(self, policy: ShardedPolicy) -> None:
        self._policy = policy

    def state_dict(self) -> dict[str, Any]:
        return self._policy._lead("optimizer_state")  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = len(self._policy._param_names)
        if sorted(int(i) for g in state["param_groups"] for i in g["params"]) != list(range(n)):
            raise DistributedTrainerError(f"optimizer checkpoint does not cover this model's {n} parameters: "
                                          "was it saved from another architecture?")
        self._policy._lead("load_optimizer", local=state)
