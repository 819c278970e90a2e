"""Episode state in one environment replica: opened at an episode's first step, kept with a TTL.

An episodic environment's state (a tool's scratch state, the turns so far, the tool time spent)
lives in the replica that served the episode's first step; the generator sends its later steps
to that replica's own subject (``rlbus.schemas.env``).  ``Episodes`` is that store: keyed by episode id,
bounded (``max_episodes``: past it a new episode is refused, not an old one dropped), and swept
(an episode idle past ``ttl_s`` is expired and its resources closed; a later step of it is
refused with an error that says it expired, so the generator ends that episode as an
environment failure instead of waiting).  ``EpisodeHost`` runs one step of an episode: it opens or finds the episode, calls the
environment, enforces the task's limits that the environment side can see (turns, tool time),
and closes the episode when it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlbus.observability.logging import get_logger
from rlbus.schemas import EnvReply, EnvStep, Task
from rlbus.services.environment.envs import EnvError, EpisodicEnvironment, PolicyError, Turn
from rlbus.services.runtime.tokens import TextCodec

log = get_logger()
# Ids of expired episodes remembered, so that a late step is told "expired" rather than "unknown".
EXPIRED_MEMORY = 4096


class EpisodeError(EnvError):
    """A step names an episode this replica cannot serve (unknown, expired, full); not retryable."""


@dataclass
class Episode:
    episode_id: str
    task: Task
    env: EpisodicEnvironment
    state: Any  # the environment's own (what its ``open`` returned)
    touched_at: float
    turns: int = 0  # policy turns served
    tool_s: float = 0.0  # tool seconds spent, summed over turns
    last_reply: EnvReply | None = None  # answered again to a repeated step (a retried request)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one step of an episode at a time


class Episodes:
    """The open episodes of one replica: bounded, each expiring ``ttl_s`` after its last step."""

    def __init__(self, *, ttl_s: float, max_episodes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_episodes, self.clock = ttl_s, max_episodes, clock
        self._open: dict[str, Episode] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.opened = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, episode_id: str) -> bool:
        return episode_id in self._open

    def open(self, episode_id: str, task: Task, env: EpisodicEnvironment) -> Episode:
        if len(self._open) >= self.max_episodes:
            self.sweep()
        if len(self._open) >= self.max_episodes:
            raise EpisodeError(
                f"this environment replica already holds max_episodes={self.max_episodes} open episodes; episode "
                f"{episode_id!r} was not opened. Raise [environment] max_episodes, add environment replicas, or lower "
                f"episode_ttl_s (now {self.ttl_s:g} s) so abandoned episodes free their place sooner")
        state = env.open(task, episode_id)
        ep = Episode(episode_id=episode_id, task=task, env=env, state=state, touched_at=self.clock())
        self._open[episode_id] = ep
        self.opened += 1
        return ep

    def get(self, episode_id: str, turn: int) -> Episode:
        ep = self._open.get(episode_id)
        if ep is not None and not self._is_expired(ep):
            ep.touched_at = self.clock()
            return ep
        if ep is not None:
            self._expire(ep)
        if episode_id in self._expired:
            raise EpisodeError(
                f"episode {episode_id!r} expired: no step for more than episode_ttl_s={self.ttl_s:g} s before turn "
                f"{turn}, so its state was closed. Raise [environment] episode_ttl_s if tool turns legitimately wait "
                "that long")
        raise EpisodeError(
            f"episode {episode_id!r} is not open on this replica (turn {turn}): it was never opened here, it "
            "already ended, or the replica restarted. An episode's later steps go to the subject of the replica "
            "named in its first step's reply (EnvReply.replica)")

    def close(self, episode_id: str) -> None:
        ep = self._open.pop(episode_id, None)
        if ep is not None:
            _close(ep)

    def sweep(self) -> int:
        """Expire every idle episode (not one whose step is running); returns how many."""
        stale = [ep for ep in self._open.values() if self._is_expired(ep) and not ep.lock.locked()]
        for ep in stale:
            self._expire(ep)
        return len(stale)

    def close_all(self) -> None:
        for episode_id in list(self._open):
            self.close(episode_id)

    def _is_expired(self, ep: Episode) -> bool:
        return self.clock() - ep.touched_at > self.ttl_s

    def _expire(self, ep: Episode) -> None:
        self._open.pop(ep.episode_id, None)
        _close(ep)
        self.expired += 1
        self._expired[ep.episode_id] = None
        while len(self._expired) > EXPIRED_MEMORY:
            self._expired.popitem(last=False)
        log.info("episode_expired", episode_id=ep.episode_id, turns=ep.turns, ttl_s=self.ttl_s)


def _close(ep: Episode) -> None:
    try:
        ep.env.close(ep.state)
    except Exception as exc:  # noqa: BLE001 - a failing close must not keep the episode or stop the sweep
        log.warning("episode_close_failed", episode_id=ep.episode_id, error=repr(exc))


@dataclass
class StepCounters:
    steps: int = 0
    policy_failures: int = 0
    env_failures: int = 0
    tool_s: float = 0.0


class EpisodeHost:
    """Serves the steps of episodic environments in one replica (named ``replica``)."""

    def __init__(self, codec: TextCodec, replica: str, episodes: Episodes) -> None:
        self.codec, self.replica, self.episodes = codec, replica, episodes
        self.counters = StepCounters()

    async def step(self, env: EpisodicEnvironment, req: EnvStep) -> EnvReply:
        if req.turn < 1:
            raise EpisodeError(f"turn must be >= 1 (1 opens the episode), got {req.turn}")
        if req.turn == 1 and req.episode_id not in self.episodes:
            ep = self.episodes.open(req.episode_id, req.task, env)
        else:
            ep = self.episodes.get(req.episode_id, req.turn)
        async with ep.lock:
            if ep.last_reply is not None and req.turn == ep.turns:
                return ep.last_reply  # the same step again (its reply was lost): answered, not re-run
            if req.turn != ep.turns + 1:
                raise EpisodeError(f"episode {req.episode_id!r} is at turn {ep.turns}; a step of turn {req.turn} "
                                   f"cannot follow (steps go in order, one at a time)")
            reply = await self._run(ep, req)
            ep.turns, ep.last_reply = req.turn, reply
            ep.touched_at = self.episodes.clock()  # the TTL counts idle time, not a long tool run
        if reply.done:
            self.episodes.close(req.episode_id)
        return reply

    async def _run(self, ep: Episode, req: EnvStep) -> EnvReply:
        limits = ep.task.limits
        budget = limits.max_tool_s - ep.tool_s
        self.counters.steps += 1
        try:
            turn = await ep.env.step(ep.state, req.action_text, budget)
        except PolicyError as exc:
            self.counters.policy_failures += 1
            return self._reply(req, Turn(observation=str(exc), done=True, finish_reason="policy_error"),
                               failure="policy")
        except Exception as exc:  # noqa: BLE001 - a tool's crash ends this episode, not the service
            self.counters.env_failures += 1
            log.warning("environment_failure", env=ep.task.env, episode_id=ep.episode_id, error=repr(exc))
            return self._reply(req, Turn(observation=f"the environment failed: {type(exc).__name__}: {exc}",
                                         done=True, finish_reason="env_error"), failure="environment")
        ep.tool_s += turn.tool_s
        self.counters.tool_s += turn.tool_s
        if not turn.done and ep.tool_s > limits.max_tool_s:
            turn = Turn(observation=f"tool time {ep.tool_s:.2f} s exceeds the task's max_tool_s={limits.max_tool_s:g}",
                        done=True, finish_reason="max_tool_time", tool_s=turn.tool_s)
        elif not turn.done and req.turn >= limits.max_turns:
            # No policy turn follows, so this turn's observation is never appended.
            turn = Turn(observation=f"turn {req.turn} was the task's last (max_turns={limits.max_turns})",
                        done=True, finish_reason="max_turns", tool_s=turn.tool_s)
        return self._reply(req, turn)

    def _reply(self, req: EnvStep, turn: Turn, failure: str = "") -> EnvReply:
        # An ending step appends nothing: its text says why it ended, for logs and humans.
        ids = np.zeros(0, dtype="<i4") if turn.done else np.asarray(self.codec.encode(turn.observation), dtype="<i4")
        return EnvReply(episode_id=req.episode_id, observation_ids=ids, observation_text=turn.observation,
                        done=turn.done, episodic=True, replica=self.replica, failure=failure,
                        finish_reason=turn.finish_reason if turn.done else "", tool_s=turn.tool_s)

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {"environment/episodes_open": len(self.episodes), "environment/episodes_opened": self.episodes.opened,
                "environment/episodes_expired": self.episodes.expired, "environment/steps": c.steps,
                "environment/policy_failures": c.policy_failures, "environment/env_failures": c.env_failures,
                "environment/tool_s": c.tool_s}
