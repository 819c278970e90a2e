"""The trainer's heartbeat on ``rl.<run>.metrics.trainer.<instance>``.

Names that another service reads come from ``rlbus.schemas.metric_keys`` (the controller's admission
and balance accounting, ``rlbus up``, ``rlbus status``); the rest are for people.  Per-process
counts (group outcomes, ``trainer/idle_s``) start from zero in each trainer process; the run
totals (``trainer/groups_trained_total`` …) continue from the checkpoint.  What a step's heartbeat
carries also goes to TensorBoard (``board.StepBoard``), and to Prometheus with every beat
(``rlbus.observability.metrics``).
"""

from __future__ import annotations

from collections.abc import Mapping

from rlbus.schemas.metric_keys import OUTCOMES, STALE_HELD, TrainerKeys
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.trainer.batch import Assembler
from rlbus.services.trainer.board import StepBoard
from rlbus.services.trainer.commit import Committer
from rlbus.services.trainer.counters import Counters

_BREAKDOWN = (*OUTCOMES, STALE_HELD)


class Telemetry:
    def __init__(self, beat: Beat, counters: Counters, assembler: Assembler, committer: Committer,
                 board: StepBoard | None = None) -> None:
        self._beat = beat
        self._board = board
        self._counters = counters
        self._assembler = assembler
        self._committer = committer

    def set_state(self, state: str) -> None:
        self._beat.state = state

    def set_version(self, version: int) -> None:
        """The heartbeat's own version field (``trainer/version`` follows every ``publish``)."""
        self._beat.version = version

    def publish(self, extra: Mapping[str, float] | None = None) -> None:
        """Update what the next heartbeat carries.  ``extra`` (a step's metrics) stays until the
        next step replaces it."""
        c, asm, committer = self._counters, self._assembler, self._committer
        m = self._beat.metrics
        m.update({TrainerKeys.VERSION: committer.version, TrainerKeys.STEP: committer.step,
                  TrainerKeys.GROUPS_TRAINED_TOTAL: c.groups_trained_total,
                  TrainerKeys.GROUPS_DROPPED_TOTAL: c.groups_dropped_total,
                  "trainer/rollouts_stale_total": c.rollouts_stale_total,
                  TrainerKeys.IDLE_FRACTION: c.idle_fraction, TrainerKeys.IDLE_S: c.idle_s_process,
                  TrainerKeys.PENDING_GROUPS: len(asm.kept), "trainer/unacked_groups": committer.held,
                  "trainer/held_checkpointed_groups": committer.held_checkpointed(asm.dropped)})
        for reason, n in asm.counts.items():
            m[TrainerKeys.groups(reason)] = n
        m[TrainerKeys.groups(STALE_HELD)] = asm.outcomes.total(STALE_HELD)
        for pool, counts in asm.outcomes.by_pool.items():
            for outcome in _BREAKDOWN:
                m[TrainerKeys.pool_groups(pool, outcome)] = counts[outcome]
        for generator, counts in asm.outcomes.by_generator.items():
            for outcome in _BREAKDOWN:
                m[TrainerKeys.generator_groups(generator, outcome)] = counts[outcome]
        if extra:
            m.update(extra)

    def publish_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """A step's metrics: into the next heartbeat, and the heartbeat's whole set (the counters
        with them) to TensorBoard at this step."""
        self.publish(metrics)
        if self._board is not None:
            self._board.write(step, self._beat.metrics)

    def close(self) -> None:
        if self._board is not None:
            self._board.close()

    async def send(self) -> None:
        """One heartbeat now (a step's metrics, or drops the controller should hear of at once)."""
        await self._beat.send()

    async def loop(self, life: Lifecycle) -> None:
        """A heartbeat every period until stopping, then a last one saying "stopped"."""
        await self._beat.loop(life)
