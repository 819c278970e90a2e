"""Intake: pull scored groups from the trainer's durable consumer and judge each for the next batch.

Every group pulled is offered to the ``Assembler`` (batch.py), which keeps it for a batch or drops
it with a reason (a group that can never be trained on, judge.py, is refused: dropped as invalid
and dead-lettered once its ledger entry is durable in two checkpoints, commit.py); the deliveries stay held (strongly, in the
Assembler's lists and then the Committer's) until the Committer settles them, which is what keeps
the bus heartbeating them.
While a step runs, intake goes on pulling for the next batch, so decoding and judging groups
overlaps the step instead of following it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Container

from rlbus.bus.protocol import ConsumerSpec, Delivery, Puller
from rlbus.bus.subjects import Subjects
from rlbus.observability.logging import get_logger
from rlbus.schemas import ScoredGroup
from rlbus.services.runtime.config import ConfigError, RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.trainer.batch import Assembler
from rlbus.services.trainer.commit import Committer
from rlbus.services.trainer.counters import Counters
from rlbus.services.trainer.settings import TrainerSettings
from rlbus.services.trainer.telemetry import Telemetry

log = get_logger()


def consumer_spec(run_cfg: RunSettings, cfg: TrainerSettings, subjects: Subjects) -> ConsumerSpec:
    """The durable ``trainer`` consumer of every trained pool's scored groups."""
    pools = [p for p in run_cfg.pools if p != run_cfg.eval_pool]
    window = run_cfg.admission_window_groups
    # Held un-acked: up to two checkpoints' worth of batches (acks lag one checkpoint, commit.py)
    # plus what waits for the next batch; groups dropped meanwhile are settled a batch's worth at a
    # time (Committer.settle_drops, commit_dropped), so the drop rate does not scale this.
    held_steps = 2 * cfg.checkpoint_every + 2 * (run_cfg.max_staleness + 1) + 2
    max_ack_pending = held_steps * run_cfg.batch_groups + 512
    # SCORED drops its oldest groups at its limit (rlbus.bus.retention): only groups acked long ago may
    # go, so it keeps at least twice what the trainer holds plus what is admitted but not pulled.
    # Changing these keys later updates the durable in place (rlbus.bus.streams.ensure_consumer).
    need = 2 * (held_steps + run_cfg.max_staleness + 1)
    if run_cfg.retention.scored_keep_steps < need:
        raise ConfigError(
            f"[run.retention] scored_keep_steps = {run_cfg.retention.scored_keep_steps} is too small for "
            f"[trainer] checkpoint_every = {cfg.checkpoint_every} and max_staleness = {run_cfg.max_staleness}: "
            f"SCORED could drop groups the trainer has not acked yet (it acks a group once two checkpoints "
            f"cover it); raise it to at least {need} "
            "(or checkpoint more often)")
    return ConsumerSpec(stream="SCORED", durable=subjects.durable("trainer"),
                        filter_subjects=tuple(subjects.scored(p) for p in pools), ack_wait=cfg.ack_wait, max_deliver=10,
                        max_ack_pending=max(max_ack_pending, 8 * window))


class _Either:
    """Membership in either of two containers, without copying a growing ledger."""

    def __init__(self, a: Container[str], b: Container[str]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


class Intake:
    def __init__(self, puller: Puller[ScoredGroup], assembler: Assembler, committer: Committer, counters: Counters,
                 telemetry: Telemetry, *, batch_groups: int, fetch_timeout: float, life: Lifecycle) -> None:
        self._puller = puller
        self.assembler = assembler  # holds the kept and the dropped deliveries until they are taken
        self._committer = committer
        self._counters = counters
        self._telemetry = telemetry
        self._batch_groups = batch_groups
        self._fetch_timeout = fetch_timeout
        self._life = life
        self._arrivals: dict[str, int] = {}  # decisions on the groups taken in since the current wait began

    async def fill_batch(self) -> None:
        """Pull until a batch is full or the trainer stops; the wait counts as idle time, and each
        wait is logged (``idle``: when, how long, how many groups were missing, what arrived and
        what became of it) so that `bench/pipeline_bench.py` can say what the trainer waited for."""
        t_wait, started = time.perf_counter(), time.time()
        asm = self.assembler
        short = self._batch_groups - len(asm.kept)
        self._arrivals = {}
        while not asm.full and not self._life.stopping.is_set():
            got = await self._puller.fetch(max(self._batch_groups - len(asm.kept), 1) * 2, timeout=self._fetch_timeout)
            await self._absorb(got, consumed=self._committer.consumed)
            if not got:
                self._telemetry.publish()
        waited = time.perf_counter() - t_wait
        self._counters.add_idle(waited)
        if short > 0 and asm.full:  # a wait cut by a stop waited for nothing
            log.info("idle", started=round(started, 4), wait_s=round(waited, 4), short=short,
                     **{f"arrived_{reason}": n for reason, n in self._arrivals.items()})

    async def prefetch_during(self, step: asyncio.Future[dict[str, float]], in_step: set[str]) -> None:
        """Take in what arrives for the next batch until ``step`` is done or that batch is full.
        Groups of the running step (``in_step``) count as consumed: a redelivered copy is a
        duplicate.  No ledger is written meanwhile: the step is mutating the model."""
        consumed = _Either(self._committer.consumed, in_step)
        while not step.done() and not self.assembler.full:
            got = await self._puller.fetch(self._batch_groups, timeout=0.05)
            await self._absorb(got, consumed=consumed, may_commit=False)
            if not got:
                await asyncio.wait([step], timeout=0.05)

    async def _absorb(self, got: list[Delivery[ScoredGroup]], *, consumed: Container[str],
                      may_commit: bool = True) -> None:
        asm = self.assembler
        dropped = 0
        for d in got:
            decision = asm.offer(d.msg, d, version=self._committer.version, consumed=consumed)
            self._arrivals[decision.reason] = self._arrivals.get(decision.reason, 0) + 1
            if decision.reason not in ("train", "duplicate"):
                dropped += 1
            if decision.refusal and decision.reason != "duplicate":
                log.warning("group_refused", task_id=d.msg.task.task_id, pool=d.msg.task.pool, subject=d.subject,
                            reason=decision.refusal)
        if dropped:
            # Frees admission budget now (the ack still waits for a checkpoint): the controller
            # re-admits dropped groups only once it hears of them, so tell it now rather than at
            # the next periodic heartbeat, or the trainer idles meanwhile.
            self._counters.groups_dropped_total += dropped
            self._telemetry.publish()
            await self._telemetry.send()
        if may_commit and len(asm.dropped) >= self._batch_groups:
            taken, asm.dropped = asm.dropped, []
            await self._committer.commit_dropped(taken)
            self._telemetry.publish()

    async def release(self) -> None:
        """Give back every group held for a batch (nak: redelivered now, to whoever pulls next)."""
        for d in [*self.assembler.kept, *self.assembler.dropped]:
            try:
                await d.handle.nak()
            except Exception as exc:  # noqa: BLE001 - the connection may already be gone
                log.warning("nak_on_shutdown_failed", error=repr(exc))
