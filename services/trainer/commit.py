"""The trainer's durable record, and the acks that record allows.

A scored group is acked only once a checkpoint on disk covers it, because acking is what tells
the stream it never has to deliver the group again:

- a trained group: the checkpoint of a step at or after the one that used it (model, optimiser
  and the ledger of consumed group ids, written together, ``checkpoint.save``);
- a dropped group (filtered, invalid, stale): its ledger entry, in a checkpoint or in a
  ledger-only save (``checkpoint.save_ledger``) when many are dropped while no batch fills;
- a refused group (invalid because it can never be trained on, ``GroupDecision.refusal``) is
  settled at the same point, but terminated and dead-lettered with its reason instead of acked, so
  an operator sees why; a crash before the term redelivers it, and the copy is refused again;
- a duplicate (a redelivered copy of a group already consumed or waiting in a batch): acking it
  acks its original, the same message, so it waits until the original's id is in a checkpoint.

A crash redelivers everything un-acked; the ledger of the checkpoint it resumes from turns
redeliveries of committed groups into duplicates, so no group is trained twice in the surviving
model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import KeysView
from pathlib import Path

import torch

from observability.logging import get_logger
from services.trainer import checkpoint
from services.trainer.batch import GroupDecision, ledger_entries, ready_to_ack
from services.trainer.counters import Counters
from services.trainer.versions import VersionBook

log = get_logger()


async def settle(d: GroupDecision) -> None:
    """Settle a group its checkpoint covers: ack, or dead-letter a refused one with its reason."""
    if d.refusal:
        log.warning("group_dead_lettered", task_id=d.group.task.task_id, pool=d.group.task.pool, reason=d.refusal)
        await d.handle.term(d.refusal)
    else:
        await d.handle.ack()


class Committer:
    def __init__(self, ckpt_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: checkpoint.TrainerState, counters: Counters, *, checkpoint_every: int, keep: int) -> None:
        self._dir = ckpt_dir
        self._model = model
        self._optimizer = optimizer
        self._counters = counters
        self._every = checkpoint_every
        self._keep = keep
        # step, version and the ledger (group id -> "train" or why it was dropped), as of the last
        # step: ahead of the newest checkpoint by the steps since it.
        self.state = state
        self.restored_version = state.version  # the version of the checkpoint resumed from
        self.unacked: list[GroupDecision] = []  # consumed or dropped since the last checkpoint

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def consumed(self) -> KeysView[str]:
        """Ids of every group trained on or dropped (committed or not): a redelivery is a duplicate."""
        return self.state.consumed.keys()

    def resume(self, used: int) -> bool:
        """Continue after the highest version any trainer of the run may have used (``used``:
        handed out, uploaded or published): a version number never names two different sets of
        weights.  True when this trainer resumes a run (then generators may hold weights of
        steps lost with a crash)."""
        self.restored_version = self.state.version
        resumed = self.state.step > 0 or used > self.state.version
        self.state.version = max(self.state.version, used)
        return resumed

    def new_lineage(self, book: VersionBook) -> None:
        """A version of its own for the weights this trainer resumes from, recorded in ``book`` as
        a fork of the checkpoint's version (durable before anyone sees it): versions between the
        two are a lost lineage, which staleness measures through the fork (versions.py)."""
        self.state.version += 1
        book.fork(self.state.version, self.restored_version)

    def record_step(self, batch: list[GroupDecision], dropped: list[GroupDecision]) -> None:
        """A step trained ``batch``: a new version, its groups consumed, and every group dropped
        before it recorded with its reason; all of them now wait for a checkpoint to be acked."""
        self.state.step += 1
        self.state.version += 1
        for d in batch:
            self.state.consumed[d.group.task.task_id] = "train"
        for gid, reason in ledger_entries(dropped).items():
            self.state.consumed.setdefault(gid, reason)
        self.unacked.extend(batch + dropped)

    @property
    def checkpoint_due(self) -> bool:
        return self.state.step % self._every == 0

    async def commit(self) -> float:
        """Checkpoint, then ack everything it covers.  Returns the checkpoint seconds."""
        t0 = time.perf_counter()
        self.state.counters = self._counters.record()
        await asyncio.to_thread(checkpoint.save, self._dir, self._model, self._optimizer, self.state, keep=self._keep)
        spent = time.perf_counter() - t0
        done, self.unacked = ready_to_ack(self.unacked, self.state.consumed)
        for d in done:
            await settle(d)
        return spent

    async def commit_dropped(self, dropped: list[GroupDecision]) -> None:
        """Many groups dropped and no batch yet (e.g. every reward equal): make their ledger
        entries durable and ack them, instead of holding them against max_ack_pending.  Never
        call it while a step runs: with no checkpoint yet it writes a full one of the model."""
        entries = ledger_entries(dropped)
        for gid, reason in entries.items():
            self.state.consumed.setdefault(gid, reason)
        self.state.counters = self._counters.record()
        await asyncio.to_thread(checkpoint.save_ledger, self._dir, self._model, self._optimizer, self.state,
                                keep=self._keep, dropped=entries)
        # A ledger-only save commits no trained group: duplicates wait for the next commit().
        now, later = ready_to_ack(dropped, committed=())
        self.unacked.extend(later)
        for d in now:
            await settle(d)
