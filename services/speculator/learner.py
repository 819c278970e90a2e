"""The speculator's moving parts, free of bus I/O: rollouts made into distillation samples, the
buffer they wait in, the book of draft version numbers, and the learner that steps the draft.

Temperature: one distiller trains one draft towards the policy's distribution at one sampling
temperature (services/policy/distill.py: the loss is taken on logits / T, the q the drafter
samples).  The learner takes the temperature of the first group it can train on and keeps it;
a group sampled at another temperature (another pool's settings, a greedy held-out round) is
acknowledged and counted as skipped, not trained on: fitting one q to a blend of temperatures
matches none of them, and such a group is valid data (the trainer uses it), so it is no dead
letter.  A run whose training pools sample at several temperatures gets a draft for the first.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlbus.schemas import ScoredGroup
from rlbus.schemas.metric_keys import SpeculatorKeys
from rlbus.services.policy.distill import DistillInputError, DraftDistiller, PolicySample
from rlbus.services.runtime.files import NumberBook

BOOK_FILE = "draft_versions.json"


def samples_of(group: ScoredGroup) -> list[PolicySample]:
    """Each rollout the policy sampled as a `PolicySample`.  Left out: rollouts an environment
    failure ended (the trainer excludes them too) and rollouts with no completion token."""
    out = []
    for scored in group.scored:
        r = scored.rollout
        if r.env_error or scored.env_failure or r.completion_len == 0:
            continue
        ids = np.asarray(r.token_ids).tolist()
        mask = np.asarray(r.loss_mask).tolist() if len(r.loss_mask) else None
        out.append(PolicySample(prompt=ids[:r.prompt_len], completion=ids[r.prompt_len:], loss_mask=mask))
    return out


def newest_policy_version(group: ScoredGroup) -> int:
    """The newest policy version whose tokens the group holds (-1: none recorded)."""
    return max((s.rollout.newest_version for s in group.scored), default=-1)


class SampleBuffer:
    """Samples waiting for a distillation step, oldest first, each with the newest policy version
    of its group.  Bounded: once full, the oldest are pushed out (and counted), because an online
    draft should follow the newest policy rather than work through a backlog of samples of
    weights long gone."""

    def __init__(self, capacity: int) -> None:
        self.items: deque[tuple[PolicySample, int]] = deque()
        self.capacity = capacity
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.items)

    def add(self, samples: Sequence[PolicySample], policy_version: int) -> None:
        self.items.extend((s, policy_version) for s in samples)
        while len(self.items) > self.capacity:
            self.items.popleft()
            self.dropped += 1

    def take(self, n: int) -> tuple[list[PolicySample], int]:
        """Up to ``n`` oldest samples and the newest policy version among them (-1: none)."""
        taken = [self.items.popleft() for _ in range(min(n, len(self.items)))]
        return [s for s, _ in taken], max((v for _, v in taken), default=-1)


class DraftBook(NumberBook):
    """The highest draft version number handed out, in ``<run_dir>/speculator/draft_versions.json``
    (a restarted speculator whose previous upload was still in flight must not reuse it)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root / BOOK_FILE)
        if self.path.exists():
            try:
                self.highest = int(json.loads(self.path.read_text())["highest"])
            except (ValueError, KeyError, TypeError) as exc:
                raise DistillInputError(
                    f"{self.path} is unreadable ({exc!r}): it records the highest draft version handed out. "
                    "Move it aside to continue: the speculator then numbers on from the newest published draft") from None


@dataclass
class Counters:
    steps: int = 0
    samples: int = 0
    groups: int = 0
    groups_skipped: int = 0
    groups_dead: int = 0
    loss: float = 0.0
    published_version: int = 0  # 0: the initial draft (draft_model_path), which no manifest carries
    published_on: int = 0  # the policy version the published draft was distilled on (0: the initial policy)
    policy_version: int = -1  # the newest policy version seen in a group taken in
    temperature: float | None = None
    skipped_why: dict[str, int] = field(default_factory=dict)


class Learner:
    """Groups in, samples buffered, minibatch steps on the draft.  The bus side (acks, dead
    letters, uploads) is the service's; everything here can be tested with plain groups."""

    def __init__(self, distiller: DraftDistiller, *, batch_samples: int, buffer_samples: int) -> None:
        self.distiller = distiller
        self.batch_samples = batch_samples
        self.buffer = SampleBuffer(buffer_samples)
        self.c = Counters()
        self.trained_on = -1  # newest policy version among the samples of the steps since the last upload

    def offer(self, group: ScoredGroup) -> str | None:
        """Buffer the group's samples; the reason it was skipped (None: taken).  Raises
        `DistillInputError` for a group that can never be trained on (ids outside the draft's
        vocabulary, longer than its context, a mask that does not fit)."""
        t = group.sampling.temperature
        if not t > 0.0:
            return self._skip("greedy")  # a greedy round carries no distribution to match
        if self.c.temperature is not None and t != self.c.temperature:
            return self._skip("other_temperature")
        samples = samples_of(group)
        for i, sample in enumerate(samples):
            self.distiller.check(sample, i)
        if not any(any(s.mask()) for s in samples):
            return self._skip("no_policy_token")
        if self.c.temperature is None:
            self.c.temperature = t
            self.distiller.temperature = t
        version = newest_policy_version(group)
        self.buffer.add(samples, version)
        self.c.groups += 1
        self.c.samples += len(samples)
        self.c.policy_version = max(self.c.policy_version, version)
        return None

    def _skip(self, why: str) -> str:
        self.c.groups_skipped += 1
        self.c.skipped_why[why] = self.c.skipped_why.get(why, 0) + 1
        return why

    @property
    def batch_ready(self) -> bool:
        return len(self.buffer) >= self.batch_samples

    def take_batch(self) -> tuple[list[PolicySample], int]:
        """The next minibatch and the newest policy version among its samples (on the event loop,
        where groups are offered; the step itself then runs in a worker thread)."""
        return self.buffer.take(self.batch_samples)

    def distil(self, batch: list[PolicySample]) -> float:
        """One optimiser step of the draft on ``batch`` (worker thread: it touches only the model)."""
        return self.distiller.step(batch)

    def record_step(self, loss: float, policy_version: int) -> None:
        self.c.steps += 1
        self.c.loss = loss
        # What the next published draft has seen: never lower, as every earlier step is in it too.
        self.trained_on = max(self.trained_on, policy_version)

    def metrics(self) -> dict[str, float]:
        c = self.c
        return {SpeculatorKeys.STEPS: c.steps, SpeculatorKeys.LOSS: c.loss, SpeculatorKeys.SAMPLES: c.samples,
                SpeculatorKeys.SAMPLES_DROPPED: self.buffer.dropped, SpeculatorKeys.GROUPS: c.groups,
                SpeculatorKeys.GROUPS_SKIPPED: c.groups_skipped, SpeculatorKeys.GROUPS_DEAD: c.groups_dead,
                SpeculatorKeys.PUBLISHED_VERSION: c.published_version,
                SpeculatorKeys.POLICY_VERSION: c.policy_version,
                SpeculatorKeys.POLICY_VERSION_LAG: max(c.policy_version - c.published_on, 0)
                if c.policy_version >= 0 else 0.0,
                "speculator/buffered": len(self.buffer)}
