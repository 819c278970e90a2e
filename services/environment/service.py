"""environment service — request/reply environments for generators.

consumes:  rl.<run>.env.<name>.reset        (EnvReset)       core request/reply, queue group 'environment'
           rl.<run>.env.<name>.reset_batch  (EnvResetBatch)  a generator batch's resets in one round trip
           rl.<run>.env.<name>.step         (EnvStep)
produces:  EnvReply (EnvReplyBatch for a batch) to the requester (observation tokens, done, error)
waits for: nothing; stateless per request, so replicas scale by queue group
An unknown environment name or a bad task gets an EnvReply with ``error`` set (the generator
dead-letters the task with that reason); the service never dies on bad input.
"""

from __future__ import annotations

from bus.protocol import Bus
from bus.subjects import Subjects
from observability import tracing
from observability.logging import get_logger
from schemas import EnvReply, EnvReplyBatch, EnvReset, EnvResetBatch, EnvStep, SchemaError
from services.environment.envs import ENVIRONMENTS, EnvError, Environment
from services.environment.settings import EnvironmentSettings
from services.runtime.config import RunSettings
from services.runtime.heartbeat import Beat
from services.runtime.lifecycle import Lifecycle, run_until_stopped
from services.runtime.registry import UnknownExtension
from services.runtime.tokens import TextCodec

log = get_logger()


class EnvironmentServer:
    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self._envs: dict[str, Environment] = {}
        self.served = 0
        self.errors = 0

    def env(self, name: str) -> Environment:
        if name not in self._envs:
            self._envs[name] = ENVIRONMENTS.create(name, codec=self.codec)
        return self._envs[name]

    def _answer(self, fn) -> EnvReply:  # type: ignore[no-untyped-def]
        try:
            reply = fn()
            self.served += 1
            return reply
        except (SchemaError, EnvError, UnknownExtension) as exc:
            self.errors += 1
            log.warning("env_request_rejected", error=str(exc))
            return EnvReply(episode_id="", error=str(exc))

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
        # Each task is answered on its own: one unknown environment refuses that task only; and in
        # its own trace (the request carries each task's context).
        replies = []
        for task, ctx in zip(req.tasks, tracing.item_contexts(len(req.tasks)), strict=True):
            span = tracing.start_child(f"environment reset {task.env}", ctx, **{
                tracing.TASK_ID: task.task_id, tracing.ENV: task.env, tracing.POOL: task.pool})
            try:
                reply = self._answer(lambda t=task: self.env(t.env).reset(t, t.task_id))
                span.set_attribute(tracing.PROMPT_TOKENS, len(reply.observation_ids))
                if reply.error:
                    span.set_attribute(tracing.ERROR, reply.error[:500])
            finally:
                span.end()
            replies.append(reply)
        return EnvReplyBatch(replies=replies).encode()

    async def handle_step(self, data: bytes) -> bytes:
        def go() -> EnvReply:
            req = EnvStep.decode(data)
            tracing.annotate(**{tracing.TASK_ID: req.task.task_id, tracing.ENV: req.task.env})
            return self.env(req.task.env).step(req.task, req.episode_id, req.action_ids, req.action_text)

        return self._answer(go).encode()


async def run(run_cfg: RunSettings, cfg: EnvironmentSettings, *, bus: Bus, life: Lifecycle) -> None:
    subjects = Subjects(run_cfg.run)
    server = EnvironmentServer(TextCodec.from_folder(run_cfg.model_path))
    beat = Beat(bus, subjects, "environment", cfg.instance)
    beat.extra = lambda: {"environment/served": server.served, "environment/errors": server.errors}
    await bus.serve(subjects.env_any("reset"), server.handle_reset, queue=subjects.env_queue_group)
    await bus.serve(subjects.env_any("reset_batch"), server.handle_reset_batch, queue=subjects.env_queue_group)
    await bus.serve(subjects.env_any("step"), server.handle_step, queue=subjects.env_queue_group)
    beat.state = "running"
    log.info("environment_ready", envs=ENVIRONMENTS.names())
    await run_until_stopped(life, lambda: beat.loop(life))
