"""The reward-hacking alarm: training reward rises while held-out accuracy falls.  No I/O.

A policy that learns to please its reward (a verifier with a hole, a test it can tamper with, a
format the checker over-credits) shows it as a rising training reward with a falling accuracy on
tasks it never trains on.  ``DivergenceMonitor`` watches both over the last ``window`` policy
versions and fires when each moves the wrong way clearly:

- training reward: the trainer's batch mean (``batch/reward_mean``) per version, from its heartbeat;
- held-out accuracy: the mean reward of each held-out round, per version the controller scheduled
  it at, from the scored groups of the eval pool (``HeldOutRounds``; a round counts once complete).

A trend is the change of a least-squares line across the readings in the window.  Noise must not
fire it: each trend must pass its margin (``reward_rise``, ``heldout_drop``) *and* be ``z`` standard
errors from zero, with at least ``min_steps`` reward and ``min_heldout`` held-out readings.  The
held-out standard error comes from each round's own sampling noise (its rewards' variance over its
size), which the controller knows exactly; the reward's from the residuals of its fit (many
readings).  Once firing, it clears only when the condition fails at half the margins and half ``z``,
so a trend hovering at the threshold does not flap; with too few readings the state stands.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass as plain_dataclass
from typing import Annotated

from pydantic import ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from rlbus.observability.logging import get_logger
from rlbus.schemas import Heartbeat, ScoredGroup
from rlbus.schemas.control import Divergence
from rlbus.schemas.metric_keys import TrainerKeys

log = get_logger()

MAX_VERSION = 1 << 40  # a version beyond this is no version a trainer reaches (see state.MAX_COUNT)
CHECK = ("reward hacking (the policy games the verifier: tampered tests, fake success markers, formats the "
         "checker over-credits) or a verifier bug (it pays for wrong answers); read a few recent high-reward "
         "training rollouts against the held-out failures")


@dataclass(frozen=True, kw_only=True, config=ConfigDict(extra="forbid", use_attribute_docstrings=True))
class DivergenceConfig:
    """The ``[controller.divergence]`` table: when training reward and held-out accuracy part ways."""

    window: Annotated[int, Field(ge=4, le=1_000_000)] = 50
    """Policy versions the alarm looks back over (the latest reading's version and the ones before it).
    Held-out rounds come every ``eval_every`` versions: the window should hold at least
    ``min_heldout`` of them."""

    reward_rise: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 0.05
    """Least rise of the training reward's fitted line across the window (reward units) to count
    as rising."""

    heldout_drop: Annotated[float, Field(gt=0, le=1)] = 0.05
    """Least fall of held-out accuracy's fitted line across the window (a fraction) to count as
    falling."""

    min_heldout: Annotated[int, Field(ge=3, le=10_000)] = 3
    """Held-out rounds the window must hold before the alarm judges (two always fit a line; a third
    shows the fall is not one bad round)."""

    min_steps: Annotated[int, Field(ge=3, le=1_000_000)] = 8
    """Training-reward readings (steps) the window must hold before the alarm judges."""

    z: Annotated[float, Field(ge=0, le=10)] = 3.0
    """Standard errors each trend must be from zero, besides its margin.  At 3 a plateaued held-out
    accuracy fires about once in 700 windows; at 2 about once in 40, which cries wolf."""

    @model_validator(mode="after")
    def _fits_window(self) -> DivergenceConfig:
        for name in ("min_heldout", "min_steps"):
            if getattr(self, name) > self.window:
                raise ValueError(f"{name} = {getattr(self, name)} readings cannot fit in window = {self.window} "
                                 f"versions; raise window or lower {name}")
        return self


@plain_dataclass(frozen=True)
class HeldOutReading:
    """One complete held-out round: its accuracy and that accuracy's standard error."""

    version: int
    accuracy: float
    se: float
    n: int


class HeldOutRounds:
    """Scored groups of the eval pool -> one ``HeldOutReading`` per complete round.

    A round is the ``size`` tasks scheduled at one version (``metadata['eval_version']``); each task
    counts once (a redelivered group is not a second reading).  At most ``keep`` rounds are collected
    at once: an older one still missing tasks (a task dead-lettered on the way) is given up."""

    def __init__(self, size: int, keep: int = 8) -> None:
        self.size = size
        self.keep = keep
        self.open: dict[int, dict[str, list[float]]] = {}  # version -> task id -> rewards
        self.done: deque[int] = deque(maxlen=64)  # versions of rounds already read (late duplicates)
        self.abandoned = 0

    def add(self, group: ScoredGroup) -> HeldOutReading | None:
        version = group.task.metadata.get("eval_version")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION \
                or version in self.done or self.size <= 0:
            return None
        tasks = self.open.setdefault(version, {})
        tasks[group.task.task_id] = [s.reward for s in group.scored if not s.verifier_error]
        if len(self.open) > self.keep:
            oldest = min(self.open)
            log.warning("heldout_round_abandoned", version=oldest, got=len(self.open.pop(oldest)), size=self.size,
                        why=f"{self.keep} newer rounds are open; its missing tasks were lost (see DEAD)")
            self.abandoned += 1
        if len(tasks) < self.size:
            return None
        del self.open[version]
        self.done.append(version)
        rewards = [r for rs in tasks.values() for r in rs]
        if not rewards:  # every rollout of the round failed its verifier: no accuracy to read
            return None
        mean = sum(rewards) / len(rewards)
        var = sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1) if len(rewards) > 1 else 0.0
        return HeldOutReading(version, mean, math.sqrt(var / len(rewards)), len(rewards))


@plain_dataclass(frozen=True)
class Fit:
    """A least-squares line through readings: its change across them and that change's standard error."""

    change: float
    se: float
    n: int

    @classmethod
    def of(cls, xs: list[int], ys: list[float], variances: list[float] | None = None) -> Fit | None:
        """None for fewer than 3 readings or one version only.  ``variances``: each reading's known
        noise; without them the noise is estimated from the residuals."""
        n = len(xs)
        if n < 3 or max(xs) == min(xs):
            return None
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        if variances is None:
            resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
            var_slope = resid / (n - 2) / sxx
        else:
            var_slope = sum(((x - mx) / sxx) ** 2 * v for x, v in zip(xs, variances, strict=True))
        span = max(xs) - min(xs)
        return cls(slope * span, math.sqrt(var_slope) * span, n)

    def rises(self, margin: float, z: float) -> bool:
        """Up by at least ``margin``, and ``z`` standard errors clear of flat."""
        return self.change >= margin and self.change >= z * self.se

    def falls(self, margin: float, z: float) -> bool:
        return -self.change >= margin and -self.change >= z * self.se


@plain_dataclass(frozen=True)
class Trends:
    """Both fitted trends over one window (None: too few readings to fit)."""

    reward: Fit | None
    heldout: Fit | None
    from_version: int
    to_version: int


class DivergenceMonitor:
    """Readings in, a ``Divergence`` record out whenever the alarm fires or clears."""

    def __init__(self, cfg: DivergenceConfig) -> None:
        self.cfg = cfg
        self.rewards: dict[int, float] = {}  # version -> batch reward mean of the step that made it
        self.heldout: dict[int, HeldOutReading] = {}  # version -> its held-out round
        self.firing = False
        self.published = 0  # records this process issued (``restore`` applies only before the first)
        self.trends = Trends(None, None, 0, 0)

    # --- readings ---------------------------------------------------------------------------
    def observe_trainer(self, hb: Heartbeat) -> None:
        """The reward of the step that made the heartbeat's version.  The step's metrics ride on
        every heartbeat until the next step, so a repeat only rewrites the same reading."""
        version, reward = hb.metrics.get(TrainerKeys.VERSION), hb.metrics.get(TrainerKeys.REWARD_MEAN)
        if version is None or reward is None or not math.isfinite(reward) or not math.isfinite(version) \
                or not 0 <= version <= MAX_VERSION:
            return
        self.observe_reward(int(version), reward)

    def observe_reward(self, version: int, reward: float) -> None:
        if self.rewards and version < max(self.rewards):
            # The trainer went back to an earlier checkpoint: what was measured after it is another history.
            self.rewards = {v: r for v, r in self.rewards.items() if v < version}
            self.heldout = {v: h for v, h in self.heldout.items() if v <= version}
        self.rewards[version] = reward
        self._prune()

    def observe_heldout(self, reading: HeldOutReading) -> None:
        self.heldout[reading.version] = reading
        self._prune()

    def _prune(self) -> None:
        newest = max([*self.rewards, *self.heldout], default=0)
        oldest = newest - self.cfg.window + 1
        self.rewards = {v: r for v, r in self.rewards.items() if v >= oldest}
        self.heldout = {v: h for v, h in self.heldout.items() if v >= oldest}

    # --- the judgement ------------------------------------------------------------------------
    def fit(self) -> Trends:
        rv, hv = sorted(self.rewards), sorted(self.heldout)
        reward = Fit.of(rv, [self.rewards[v] for v in rv]) if len(rv) >= self.cfg.min_steps else None
        heldout = (Fit.of(hv, [self.heldout[v].accuracy for v in hv], [self.heldout[v].se ** 2 for v in hv])
                   if len(hv) >= self.cfg.min_heldout else None)
        versions = [*rv, *hv]
        return Trends(reward, heldout, min(versions, default=0), max(versions, default=0))

    def diverging(self, t: Trends, scale: float = 1.0) -> bool | None:
        """Reward up and held-out down, each by ``scale`` x its margin and z; None: too few readings."""
        if t.reward is None or t.heldout is None:
            return None
        c = self.cfg
        return t.reward.rises(c.reward_rise * scale, c.z * scale) and t.heldout.falls(c.heldout_drop * scale,
                                                                                      c.z * scale)

    def check(self) -> Divergence | None:
        """A record when the alarm fires or clears, else None."""
        self.trends = t = self.fit()
        verdict = self.diverging(t, 0.5 if self.firing else 1.0)
        if verdict is None or verdict == self.firing or t.reward is None or t.heldout is None:
            return None
        self.firing = verdict
        self.published += 1
        return Divergence(firing=verdict, reward_trend=round(t.reward.change, 6),
                          heldout_trend=round(t.heldout.change, 6), from_version=t.from_version,
                          to_version=t.to_version, heldout_readings=t.heldout.n,
                          detail=describe(t.reward, t.heldout, t, firing=verdict))

    def restore(self, record: Divergence) -> None:
        """This controller's last record, read back from CONTROL after a restart: a firing alarm
        stays firing (and is cleared by a record) until the readings say otherwise."""
        if self.published == 0:
            self.firing = record.firing

    def metrics(self) -> dict[str, float]:
        t = self.trends
        m = {"controller/divergence": float(self.firing),
             "controller/divergence/heldout_readings": float(len(self.heldout))}
        if t.reward is not None:
            m["controller/divergence/reward_trend"] = t.reward.change
        if t.heldout is not None:
            m["controller/divergence/heldout_trend"] = t.heldout.change
        return m


def describe(reward: Fit, heldout: Fit, t: Trends, *, firing: bool) -> str:
    """The record's detail and the log's words: both trends, their noise, and what to check."""
    trends = (f"training reward {reward.change:+.3f} (±{reward.se:.3f}, {reward.n} steps) and held-out accuracy "
              f"{heldout.change:+.3f} (±{heldout.se:.3f}, {heldout.n} rounds) over versions "
              f"{t.from_version}..{t.to_version}")
    if not firing:
        return f"{trends}: no longer parting ways"
    return f"{trends}: the policy earns more reward while solving fewer held-out tasks; check {CHECK}"
