"""The trainer's steps as TensorBoard scalars, in ``<run_dir>/tensorboard``.

A step's scalars are the trainer heartbeat's metrics as that step left them (``Telemetry``),
which is also the row ``rlbus up`` writes to ``metrics.jsonl``: the two never disagree, and a run
deployed without ``rlbus up`` (systemd, containers) still has its curves.  View them with
``tensorboard --logdir <run_dir>/tensorboard``.

Written by ``torch.utils.tensorboard`` (the ``tensorboard`` package's writer), not tensorboardX:
tensorboardX's ``flush`` does not wait for the events still queued for its writer thread, so a
step could be missing from the file until the next periodic flush; this one's ``flush`` blocks
until every queued event is on disk.  Flushed at every step, so a crash loses no step already
reported; a resumed trainer hides the steps written after its checkpoint by the run that crashed
(``purge_step``), since it trains those steps again.

TensorBoard reads a folder's event files in the order of their names, and a name carries its
creation time in whole seconds, then host, pid and a per-process counter, all compared as text: a
trainer resumed within the second its predecessor's file was made could sort before it (a counter
of 10 sorts before 9), and its purge would then be read first and undo nothing.  A new writer
therefore waits, when it must, for the second after the newest file's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

EVENT_FILE_PREFIX = "events.out.tfevents."


class StepBoard:
    """One event-file writer for one trainer process; ``close`` is safe to call twice."""

    def __init__(self, folder: Path, *, resumed_at: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # about 0.5 s beside torch: only the trainer pays it

        self.folder = folder
        # Steps after ``resumed_at`` that a crashed predecessor wrote are trained again from the
        # checkpoint: TensorBoard is told to drop them, or each would show two points.
        purge = resumed_at + 1 if resumed_at > 0 else None
        wait_past_newest_file(folder)
        self._writer: SummaryWriter | None = SummaryWriter(log_dir=str(folder), purge_step=purge)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Every metric as the scalar of its name (its path-like name is its TensorBoard tag)."""
        if self._writer is None:
            return
        for tag, value in metrics.items():
            self._writer.add_scalar(tag, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


def wait_past_newest_file(folder: Path) -> None:
    """Sleep (a second at most) until the clock's whole second is later than the creation second named
    by the newest event file in ``folder``, so a file made now sorts after every earlier one."""
    stamps = (p.name.removeprefix(EVENT_FILE_PREFIX).split(".", 1)[0] for p in folder.glob(EVENT_FILE_PREFIX + "*"))
    newest = max((int(s) for s in stamps if s.isdigit()), default=None)
    if newest is not None:
        time.sleep(min(1.0, max(0.0, newest + 1 - time.time())))
