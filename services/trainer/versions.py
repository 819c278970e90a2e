"""Weight version numbers: which were handed out, and which weights each one descends from.

A version number names one set of weights forever: weight-broadcast and the bus dedupe uploads by
it (``upload.<model>.v<N>``), so a number used twice would silently drop the second set.  A
restarted trainer therefore continues above every number any earlier trainer of the run could
have used, including uploads still in flight when it died.  ``VersionBook`` keeps the highest
number handed out in a small durable file, written before a version's bytes or manifest leave the
trainer; the service also reads the newest published version on the bus.  (Not the newest message
on the uploads subject: unverified, a forged one would move every later number.)

Versions form a tree, not a line.  A resumed trainer restarts from its checkpoint (version ``c``)
under a new number ``n`` above everything used: the versions between them (the dead trainer's
steps after ``c``) belong to a lost lineage that the restored model never had.  ``Lineage`` records
these forks (``n`` restarts from ``c``) and measures staleness as the number of optimiser updates
between the sample's weights and the trainer's, along the tree: up from the sample's version to
the newest ancestor it shares with the trainer's lineage, then down to the trainer's version.
A fork edge adds no update (``n`` is ``c``'s weights under a new number).  Without forks this is
the plain ``current - version``.  A sample of the lost lineage is thereby as stale as the updates
that separate it from the restored model, never "fresh" because its number happens to be close.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlbus.schemas import Rollout
from rlbus.services.runtime.files import NumberBook
from rlbus.services.trainer.errors import TrainerError

BOOK_FILE = "versions.json"


@dataclass(frozen=True)
class Lineage:
    """The forks of a run: ``(new version, checkpoint version it restarts from)``, ascending."""

    forks: tuple[tuple[int, int], ...] = ()

    def with_fork(self, new: int, parent: int) -> Lineage:
        if not 0 <= parent < new:
            raise TrainerError(f"a fork must restart from an older version: got {new} from {parent}")
        return Lineage(tuple(sorted({*self.forks, (new, parent)})))

    def _chain(self, version: int) -> list[tuple[int, int]]:
        """The ancestors of ``version`` as intervals ``(lo, hi)``, newest first; within one
        interval each version's parent is the one below it, ``lo``'s parent is the next ``hi``."""
        news = [n for n, _ in self.forks]
        out: list[tuple[int, int]] = []
        hi = version
        while True:
            i = bisect.bisect_right(news, hi) - 1
            if i < 0:
                out.append((0, hi))
                return out
            new, parent = self.forks[i]
            out.append((new, hi))
            hi = parent

    @staticmethod
    def _depth(chain: list[tuple[int, int]], version: int) -> int:
        """Updates from the head of ``chain`` down to ``version`` (one of its members)."""
        updates = 0
        for lo, hi in chain:
            if lo <= version <= hi:
                return updates + hi - version
            updates += hi - lo  # the fork edge below ``lo`` adds none
        raise TrainerError(f"version {version} is not in the chain {chain}: a bug in Lineage")

    def distance(self, current: int, version: int) -> int:
        """Optimiser updates between the weights of ``version`` and of ``current``.  A version
        above ``current`` gives ``current - version`` (negative), as without forks."""
        if not self.forks or version >= current:
            return current - version
        mine, theirs = self._chain(current), self._chain(version)
        shared = max(min(h1, h2) for l1, h1 in mine for l2, h2 in theirs if max(l1, l2) <= min(h1, h2))
        return self._depth(mine, shared) + self._depth(theirs, shared)

    def staleness(self, current: int, rollout: Rollout) -> int:
        """A rollout is as stale as its stalest token's version."""
        if not self.forks or not len(rollout.version_spans):
            return current - rollout.oldest_version
        versions: np.ndarray = np.asarray(rollout.version_spans)[:, 1]
        return max(self.distance(current, int(v)) for v in set(versions.tolist()))


class VersionBook(NumberBook):
    """The highest version number handed out and the run's forks, in ``<checkpoints>/versions.json``.

    Rewritten whole (it holds one fork per restart) through a temporary file, fsynced and renamed,
    so it is always complete.  Only the trainer (rank 0) writes it."""

    def __init__(self, root: Path, highest: int = 0, lineage: Lineage | None = None) -> None:
        super().__init__(root / BOOK_FILE, highest)
        self.lineage = lineage or Lineage()

    @classmethod
    def load(cls, root: Path) -> VersionBook:
        path = root / BOOK_FILE
        if not path.exists():
            return cls(root)
        try:
            raw = json.loads(path.read_text())
            forks = tuple((int(n), int(p)) for n, p in raw["forks"])
            return cls(root, int(raw["highest"]), Lineage(forks))
        except (ValueError, KeyError, TypeError) as exc:
            raise TrainerError(
                f"{path} is unreadable ({exc!r}): it records the highest weight version handed out and the "
                "forks of the run. Restore it from a backup; or, to continue anyway, move it aside: the trainer "
                "then takes the versions from the bus, and samples of lineages lost before are measured as if "
                "they descended in a line") from None

    def fork(self, new: int, parent: int) -> None:
        """The trainer restarts from the checkpoint of version ``parent`` as version ``new``."""
        self.lineage = self.lineage.with_fork(new, parent)
        self.highest = max(self.highest, new)
        self._write()

    def record(self) -> dict[str, Any]:
        return {**super().record(), "forks": [list(f) for f in self.lineage.forks]}
