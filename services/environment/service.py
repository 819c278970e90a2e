"""environment service — request/reply environments for generators.

consumes:  rl.<run>.env.<name>.reset              (EnvReset)       core request/reply, queue group 'environment'
           rl.<run>.env.<name>.reset_batch        (EnvResetBatch)  a generator batch's resets in one round trip
           rl.<run>.env.<name>.step               (EnvStep)        queue group: single-turn steps, and an
                                                                   episode's first step (which opens it here)
           rl.<run>.env.<name>.step.<instance>    (EnvStep)        no queue group: the later steps of the
                                                                   episodes this replica holds
produces:  EnvReply (EnvReplyBatch for a batch) to the requester (observation tokens, done, error;
           on an episodic step ``replica`` = this instance)
waits for: nothing; resets and single-turn steps are stateless (replicas scale by queue group); an
           episode's state stays in the replica that opened it until it ends or expires
           (``episodes.Episodes``), and its later steps come to that replica's own subject.
An unknown environment name, a bad task, or an unknown or expired episode gets an EnvReply with
``error`` set (the generator dead-letters the task with that reason); the service never dies on bad input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbus.bus.protocol import Bus
from rlbus.bus.subjects import Subjects
from rlbus.observability import tracing
from rlbus.observability.logging import get_logger
from rlbus.schemas import EnvReply, EnvReplyBatch, EnvReset, EnvResetBatch, EnvStep, SchemaError
from rlbus.services.environment.envs import ENVIRONMENTS, EnvError, Environment, EpisodicEnvironment
from rlbus.services.environment.episodes import EpisodeHost, Episodes
from rlbus.services.environment.settings import EnvironmentSettings
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped
from rlbus.services.runtime.registry import UnknownExtension
from rlbus.services.runtime.tokens import TextCodec

if TYPE_CHECKING:
    from rlbus.services.sandbox import Sandbox

log = get_logger()


class EnvironmentServer:
    def __init__(self, codec: TextCodec, cfg: EnvironmentSettings | None = None) -> None:
        self.codec = codec
        self.cfg = cfg or EnvironmentSettings()
        self._envs: dict[str, Environment | EpisodicEnvironment] = {}
        self._sandbox: Sandbox | None = None
        self.episodes = Episodes(ttl_s=self.cfg.episode_ttl_s, max_episodes=self.cfg.max_episodes)
        self.host = EpisodeHost(codec, self.cfg.instance, self.episodes)
        self.served = 0
        self.errors = 0

    def env(self, name: str) -> Environment | EpisodicEnvironment:
        if name not in self._envs:
            factory = ENVIRONMENTS.get(name)
            if getattr(factory, "sandboxed", False):
                self._envs[name] = factory(codec=self.codec, sandbox=self.sandbox(name),
                                           observation_chars=self.cfg.observation_chars)
            else:
                self._envs[name] = factory(codec=self.codec)
        return self._envs[name]

    def sandbox(self, env_name: str) -> Sandbox:
        """The one sandbox of this service (its uid pool and run dirs), made when an environment first needs it."""
        if self._sandbox is None:
            from rlbus.services.sandbox import Sandbox, SandboxError

            try:
                self._sandbox = Sandbox(self.cfg.sandbox)
            except SandboxError as exc:
                raise EnvError(f"environment {env_name!r} cannot run code on this replica: {exc}") from None
            log.info("sandbox_ready", isolation=self._sandbox.isolation.describe())
        return self._sandbox

    def close(self) -> None:
        """Close every open episode and the sandbox; safe to call twice."""
        self.episodes.close_all()
        if self._sandbox is not None:
            self._sandbox.close()

    def _refused(self, exc: Exception, episode_id: str = "") -> EnvReply:
        self.errors += 1
        log.warning("env_request_rejected", error=str(exc))
        return EnvReply(episode_id=episode_id, error=str(exc))

    def _answer(self, fn) -> EnvReply:  # type: ignore[no-untyped-def]
        try:
            reply = fn()
            self.served += 1
            return reply
        except REFUSALS as exc:
            return self._refused(exc)

    async def handle_reset(self, data: bytes) -> bytes:
        def go() -> EnvReply:
            req = EnvReset.decode(data)
            tracing.annotate(**{tracing.TASK_ID: req.task.task_id, tracing.ENV: req.task.env})
            return self.env(req.task.env).reset(req.task, req.task.task_id)

        return self._answer(go).encode()

    async def handle_reset_batch(self, data: bytes) -> bytes:
        try:
            req = EnvResetBatch.decode(data)
        except SchemaError as exc:
            self.errors += 1
            log.warning("env_request_rejected", error=str(exc))
            return EnvReplyBatch(replies=[], error=str(exc)).encode()
        ids = req.episode_ids or [t.task_id for t in req.tasks]
        # Each task is answered on its own: one unknown environment refuses that task only; and in
        # its own trace (the request carries each task's context).
        replies = []
        for task, episode_id, ctx in zip(req.tasks, ids, tracing.item_contexts(len(req.tasks)), strict=True):
            span = tracing.start_child(f"environment reset {task.env}", ctx, **{
                tracing.TASK_ID: task.task_id, tracing.ENV: task.env, tracing.POOL: task.pool})
            try:
                reply = self._answer(lambda t=task, e=episode_id: self.env(t.env).reset(t, e))
                span.set_attribute(tracing.PROMPT_TOKENS, len(reply.observation_ids))
                if reply.error:
                    span.set_attribute(tracing.ERROR, reply.error[:500])
            finally:
                span.end()
            replies.append(reply)
        return EnvReplyBatch(replies=replies).encode()

    async def handle_step(self, data: bytes) -> bytes:
        """One policy turn: a single-turn environment ends the episode; an episodic one is served
        by the episode host (opened here at turn 1, found here at later turns)."""
        episode_id = ""
        try:
            req = EnvStep.decode(data)
            episode_id = req.episode_id
            tracing.annotate(**{tracing.TASK_ID: req.task.task_id, tracing.ENV: req.task.env})
            env = self.env(req.task.env)
            if getattr(env, "episodic", False):
                reply = await self.host.step(env, req)  # type: ignore[arg-type]
            else:
                reply = env.step(req.task, req.episode_id, req.action_ids, req.action_text)  # type: ignore[call-arg]
            self.served += 1
            return reply.encode()
        except REFUSALS as exc:
            return self._refused(exc, episode_id).encode()

    def metrics(self) -> dict[str, float]:
        return {"environment/served": self.served, "environment/errors": self.errors, **self.host.metrics()}


REFUSALS = (SchemaError, EnvError, UnknownExtension)


async def sweep_episodes(life: Lifecycle, episodes: Episodes) -> None:
    """Expire idle episodes every quarter TTL (at most every 30 s), so abandoned ones free their state."""
    period = min(max(episodes.ttl_s / 4, 0.05), 30.0)
    while not await life.sleep(period):
        episodes.sweep()


async def run(run_cfg: RunSettings, cfg: EnvironmentSettings, *, bus: Bus, life: Lifecycle) -> None:
    subjects = Subjects(run_cfg.run)
    server = EnvironmentServer(TextCodec.from_folder(run_cfg.model_path), cfg)
    beat = Beat(bus, subjects, "environment", cfg.instance)
    beat.extra = server.metrics
    await bus.serve(subjects.env_any("reset"), server.handle_reset, queue=subjects.env_queue_group)
    await bus.serve(subjects.env_any("reset_batch"), server.handle_reset_batch, queue=subjects.env_queue_group)
    await bus.serve(subjects.env_any("step"), server.handle_step, queue=subjects.env_queue_group)
    # No queue group: only this replica holds the episodes whose steps arrive here.
    await bus.serve(subjects.env_step_of(cfg.instance), server.handle_step, queue="")
    beat.state = "running"
    log.info("environment_ready", envs=ENVIRONMENTS.names(), instance=cfg.instance)
    try:
        await run_until_stopped(life, lambda: beat.loop(life), lambda: sweep_episodes(life, server.episodes))
    finally:
        server.close()
