"""The trainer's durable record, and the acks that record allows.

Acking is what tells the stream it never has to deliver a group again, so a group is acked only
once two checkpoints on disk cover it: the newest, and the one before it, which is what a restart
falls back to when the newest is found damaged (``checkpoint.load_latest``).  Were a group acked
as soon as the newest checkpoint covered it, damage to that checkpoint would lose the group: the
fallback's ledger does not have it, and the stream would never deliver it again.  So acks lag one
checkpoint:

- a trained group: acked once the checkpoint after the first one that covers it is saved (model,
  optimiser and the ledger of consumed group ids, written together, ``checkpoint.save``);
- a dropped group (filtered, invalid, stale): the same, or at once when a ledger-only save
  (``checkpoint.save_ledger``, many groups dropped while no batch fills) gives its entry to the
  newest checkpoint and to the one before it; before two checkpoints exist that save is a full
  checkpoint instead, so drops never pile up held against ``max_ack_pending``;
- a refused group (invalid because it can never be trained on, ``GroupDecision.refusal``) is
  settled at the same point, but terminated and dead-lettered with its reason instead of acked, so
  an operator sees why; a crash before the term redelivers it, and the copy is refused again;
- a duplicate (a redelivered copy of a group already consumed or waiting in a batch): acking it
  acks its original, the same message, so it waits until the original's id is in the fallback too;
- at a clean end (``finish``: a graceful stop, or ``max_steps`` reached) there is no next
  checkpoint to wait for: the newest is read back from the disk and checked against its digests,
  and only then is everything it covers settled.

A crash redelivers everything un-acked; the ledger of the checkpoint it resumes from (the newest,
or the one before it) turns redeliveries of committed groups into duplicates, and the groups of a
damaged newest checkpoint, not in the fallback's ledger, are trained again: none is lost, and none
is trained twice in the surviving model.  The trainer holds up to two checkpoints' worth of groups
un-acked (``intake.consumer_spec`` sizes ``max_ack_pending`` for it); the bus heartbeats every
delivery held, so ``ack_wait`` never expires them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import KeysView
from pathlib import Path

import torch

from rlbus.observability.logging import get_logger
from rlbus.services.trainer import checkpoint
from rlbus.services.trainer.batch import GroupDecision, ledger_entries
from rlbus.services.trainer.counters import Counters
from rlbus.services.trainer.versions import VersionBook

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
        # Consumed or dropped since the newest checkpoint (and duplicates whose original is not in it).
        self.unacked: list[GroupDecision] = []
        # In the newest checkpoint, not in the one before it: settled at the next checkpoint.
        self.covered: list[GroupDecision] = []
        # Ids the ledger gained since the newest checkpoint: the one before it lacks them too once
        # the next checkpoint is saved.
        self._ahead: set[str] = set()
        self._final_damaged = False  # the newest checkpoint read back damaged at a clean end

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
            gid = d.group.task.task_id
            self._ahead.add(gid)
            self.state.consumed[gid] = "train"
        self._record(ledger_entries(dropped))
        self.unacked.extend(batch + dropped)

    @property
    def held(self) -> int:
        """Deliveries held un-settled (heartbeated by the bus until settled)."""
        return len(self.unacked) + len(self.covered)

    def held_checkpointed(self, also: list[GroupDecision]) -> int:
        """Distinct groups held un-acked (here, or in ``also``: what the Assembler holds) that the
        newest checkpoint on disk already records: counted both in its ledger and in the durable's
        ack-pending, so whoever accounts for every group (tests, operators) subtracts them."""
        ids = {d.group.task.task_id for d in self.covered}
        ids.update(gid for d in (*self.unacked, *also)
                   if (gid := d.group.task.task_id) in self.state.consumed and gid not in self._ahead)
        return len(ids)

    def _record(self, entries: dict[str, str]) -> None:
        for gid, outcome in entries.items():
            if gid not in self.state.consumed:
                self._ahead.add(gid)
            self.state.consumed.setdefault(gid, outcome)

    @property
    def checkpoint_due(self) -> bool:
        return self.state.step % self._every == 0

    async def commit(self) -> float:
        """Checkpoint, then settle what the checkpoint before it covers (now the fallback of this
        one).  Returns the checkpoint seconds."""
        t0 = time.perf_counter()
        self.state.counters = self._counters.record()
        await asyncio.to_thread(checkpoint.save, self._dir, self._model, self._optimizer, self.state, keep=self._keep)
        spent = time.perf_counter() - t0
        self._final_damaged = False
        only_newest, self._ahead = self._ahead, set()  # in the checkpoint just saved, not in its fallback
        now, self.covered = self.covered, []
        waiting = []
        for d in self.unacked:
            gid = d.group.task.task_id
            if d.reason != "duplicate":
                self.covered.append(d)
            elif gid not in self.state.consumed:
                waiting.append(d)  # its original still waits in a batch
            elif gid in only_newest:
                self.covered.append(d)
            else:
                now.append(d)  # its original is in the fallback already
        self.unacked = waiting
        for d in now:
            await settle(d)
        return spent

    async def commit_dropped(self, dropped: list[GroupDecision]) -> None:
        """Many groups dropped and no batch yet (e.g. every reward equal): make their ledger
        entries durable and settle them, instead of holding them against max_ack_pending.  Never
        call it while a step runs: with fewer than two checkpoints it writes a full one of the model."""
        entries = ledger_entries(dropped)
        kept = await asyncio.to_thread(checkpoint.checkpoints, self._dir)
        if len(kept) < checkpoint.KEEP_AT_LEAST and (entries or not kept):
            # No fallback for a ledger-only save to write to: a full checkpoint, which settles
            # what the one before it covered (so at most one batch of drops waits at a time).
            self._record(entries)
            self.unacked.extend(dropped)
            await self.commit()
            return
        for gid, reason in entries.items():
            self.state.consumed.setdefault(gid, reason)
        self.state.counters = self._counters.record()
        both = await asyncio.to_thread(checkpoint.save_ledger, self._dir, self._model, self._optimizer, self.state,
                                       keep=self._keep, dropped=entries)
        # A ledger-only save commits no trained group: duplicates wait for the next commit().
        for d in dropped:
            if d.reason == "duplicate" or not both:
                self.unacked.append(d)
            else:
                await settle(d)

    @property
    def held_drops(self) -> int:
        """Dropped groups recorded with a step and still held for the checkpoints to cover them."""
        return sum(_settles_alone(d) for d in (*self.unacked, *self.covered))

    async def settle_drops(self) -> int:
        """Settle the drops recorded with steps now, rather than two checkpoints later; returns how
        many.  Call it between steps.

        Why: the durable's ``max_ack_pending`` is sized for the trained groups of two checkpoint
        intervals (``intake.consumer_spec``), but every step also records the groups dropped while
        its batch filled, and when most groups are dropped (a task the policy has nearly solved:
        whole groups of reward 1) those fill it: the server stops delivering, no batch fills, so no
        step and no checkpoint comes to ack anything, and the trainer waits forever (seen in a
        729-step run, 1,367 groups held at a limit of 1,408).  A ledger-only save gives their
        entries to the newest checkpoint and to its fallback (``checkpoint.save_ledger``), after
        which they may be settled at once; before two checkpoints exist, a full checkpoint."""
        drops = [d for d in (*self.unacked, *self.covered) if _settles_alone(d)]
        if not drops:
            return 0
        kept = await asyncio.to_thread(checkpoint.checkpoints, self._dir)
        if len(kept) < checkpoint.KEEP_AT_LEAST:
            before = self.held
            await self.commit()  # settles what the checkpoint before it covered
            return before - self.held
        self.state.counters = self._counters.record()
        both = await asyncio.to_thread(checkpoint.save_ledger, self._dir, self._model, self._optimizer, self.state,
                                       keep=self._keep, dropped=ledger_entries(drops))
        if not both:
            return 0
        settled = {id(d) for d in drops}
        self.unacked = [d for d in self.unacked if id(d) not in settled]
        self.covered = [d for d in self.covered if id(d) not in settled]
        for d in drops:
            await settle(d)
        return len(drops)

    async def finish(self) -> None:
        """A clean end (graceful stop, ``max_steps`` reached): no next checkpoint will come, so
        checkpoint what is not yet, read the newest back from the disk, and settle everything it
        covers only if every byte matches its digest.  If not, nothing more is settled: a
        restart falls back to the checkpoint before it and the stream redelivers the rest."""
        if self._ahead:
            await self.commit()
        ready = [d for d in self.unacked if d.group.task.task_id in self.state.consumed]
        if self._final_damaged or (not self.covered and not ready):
            return  # nothing to settle (duplicates whose original waits in a batch stay held)
        try:
            folder = await asyncio.to_thread(checkpoint.verify_newest, self._dir)
        except checkpoint.DAMAGED as exc:
            log.error("final_checkpoint_unreadable", error=repr(exc), held=self.held,
                      action="not acking what it covers: a restart falls back to the checkpoint before it")
            self._final_damaged = True  # its bytes will not heal: not read again every time
            return
        now, self.covered = [*self.covered, *ready], []
        self.unacked = [d for d in self.unacked if d.group.task.task_id not in self.state.consumed]
        for d in now:
            await settle(d)
        log.info("final_checkpoint_verified", checkpoint=str(folder), settled=len(now))


def _settles_alone(d: GroupDecision) -> bool:
    """A dropped group (not a duplicate, whose ack is its original's): a ledger-only save covers it."""
    return d.reason not in ("train", "duplicate")
