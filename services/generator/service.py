"""generator service — sample groups for tasks, within the controller's admission grant and routing.

consumes:  rl.<run>.tasks.<pool>          (Task)            durable 'generator_<pool>' shared by replicas
           rl.<run>.weights.<model>       (WeightManifest)  latest on join, then every new version
           rl.<run>.weights.<model>-draft (WeightManifest)  the same for the draft model, only with
             [generator.speculative] drafter = "model" or "model+group" (the "static" drafters keep their
             first version for good)
           rl.<run>.control.generator.<instance|all>.<action>  (Control) the last of each action on join, one
             typed decision each: Admit (cumulative grant for this boot, the newest holds, + freshness floor);
             AssignPools (pools in priority order, the share of starts per pool); Concurrency (most groups
             per batch); RunState pause / resume / drain (finish what it holds, start nothing more, give back
             its grant).  Evaluate on 'all.evaluate' is weight-broadcast's record; the generator ignores it.
calls:     rl.<run>.env.<name>.reset_batch (EnvResetBatch -> EnvReplyBatch: per task prompt tokens, or an
             error), one request per environment name in a batch
           rl.<run>.env.<name>.step (EnvStep -> EnvReply), an episode's first turn (any replica), then
             rl.<run>.env.<name>.step.<replica> (the replica holding the episode) for its later turns
produces:  rl.<run>.rollouts.<pool>       (RolloutGroup)    msg id 'rollouts.<task_id>'
           rl.<run>.metrics.generator.<instance>  (Heartbeat)  every 0.5 s; GeneratorKeys name what the controller reads
           rl.<run>.dead.<origin>         (DeadLetter)      refused tasks, weights and decisions, with the reason
waits for: admission (grant_total > groups started) for training pools; eval tasks are not admitted
unblocked by: an Admit with room, a resume, new weights at or above the freshness floor
serves:    with openai_port > 0, an OpenAI-compatible /v1/chat/completions whose ended episodes are
             published as RolloutGroups on rl.<run>.rollouts.<pool> (services/chat/server.py)

A task passes through, in order: ``TaskIntake`` (intake.py: eval tasks first, training tasks within
the grant split by the routed shares, small grants pooled into fuller batches) -> ``BatchDriver``
(batch.py: environment resets, pinned eval weights, sampling in a worker thread by the I/O-free
``Generator`` core in core.py) -> ``Publisher`` (publisher.py: groups published, then tasks acked).
A task whose reset says it is episodic goes from the batch driver to the ``EpisodeDriver``
(episodes.py): each sample an episode of turns and environment steps (``rl.<run>.env.<name>.step``,
then ``...step.<replica>``), played on the backend's episode engine at its own pace, the group
published through the same ``Publisher`` when its last episode ends.
Beside them, ``WeightFollower`` (weight_follower.py) stages new versions and serves pinned ones, and
``ControlFollower`` (control.py) applies decisions to the core; ``Status`` (status.py) shows the
core on the heartbeat and wakes the batch loop when either changes it.

Held-out tasks carry the version their round was scheduled at (metadata 'eval_version'); with
eval_weights='pinned' they are sampled on a second copy of the model holding exactly that version,
read through the transport its manifest names, so a round is scored on one version.
A task is acked only after its group is published (a crash redelivers it; the msg id dedupes the
re-publish).  Held tasks get in-progress heartbeats well within TASK_ACK_WAIT, so the tasks of a
generator killed with -9 come back to the others within seconds.  A task the environment refuses
is terminated and dead-lettered with the reason.  New weights are fetched and digest-verified in
the background and swapped between decode steps.  A new pool assignment applies from the next
batch: tasks already fetched are finished, never dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlbus.bus.protocol import Bus
from rlbus.bus.subjects import Subjects, draft_model_name
from rlbus.observability.logging import get_logger
from rlbus.services.generator.backend import BACKENDS, Backend
from rlbus.services.generator.batch import BatchDriver, SlowdownFile
from rlbus.services.generator.control import ControlFollower
from rlbus.services.generator.core import Generator
from rlbus.services.generator.episodes import EpisodeDriver
from rlbus.services.generator.intake import TASK_ACK_WAIT, TaskIntake
from rlbus.services.generator.publisher import Publisher
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.generator.status import Status
from rlbus.services.generator.weight_follower import WeightFollower, followed_draft
from rlbus.services.policy.drafter_names import ONLINE_DRAFTERS
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped

__all__ = ["TASK_ACK_WAIT", "Generator", "SlowdownFile", "run"]

log = get_logger()


def pools_of(run_cfg: RunSettings, cfg: GeneratorSettings) -> tuple[list[str], list[str]]:
    """(training pools, eval pools) this replica serves: its own list, or all of the run's."""
    train = [p for p in (cfg.pools or run_cfg.pools) if p != run_cfg.eval_pool]
    evals = [run_cfg.eval_pool] if not cfg.pools or run_cfg.eval_pool in cfg.pools else []
    return train, evals


def build_backend(run_cfg: RunSettings, cfg: GeneratorSettings, *, pin_eval: bool) -> Backend:
    return BACKENDS.create(cfg.backend, model_path=run_cfg.model_path, dtype=cfg.dtype, deterministic=cfg.deterministic,
                           slowdown=cfg.slowdown, vllm=cfg.vllm, mid_sequence_swap=cfg.mid_sequence_swap,
                           pin_eval=pin_eval, speculative=cfg.speculative)


async def run(run_cfg: RunSettings, cfg: GeneratorSettings, *, bus: Bus, life: Lifecycle,
              backend: Backend | None = None) -> None:
    """Serve until stopped.  ``backend`` (tests) replaces the one ``cfg.backend`` would build."""
    subjects = Subjects(run_cfg.run)
    train_pools, eval_pools = pools_of(run_cfg, cfg)
    if backend is None:
        pin_eval = bool(eval_pools) and cfg.eval_weights == "pinned"
        backend = await asyncio.to_thread(build_backend, run_cfg, cfg, pin_eval=pin_eval)
    gen = Generator(backend, cfg, train_pools)
    chat = await asyncio.to_thread(chat_endpoint, bus, subjects, gen, run_cfg, cfg, train_pools) \
        if cfg.openai_port else None
    status = Status(Beat(bus, subjects, "generator", cfg.instance, period=0.5), gen)
    weights = WeightFollower(bus, subjects.weights(run_cfg.model_name), gen, status, run_dir=run_cfg.run_dir)
    control = ControlFollower(bus, subjects, cfg.instance, gen, status)
    intake = TaskIntake(bus, subjects, gen, status, life, train_pools=train_pools, eval_pools=eval_pools,
                        eval_room=cfg.max_batch_groups * run_cfg.group_size,
                        max_ack_pending=max(4 * run_cfg.admission_window_groups, 256))
    publisher = Publisher(bus, subjects, gen, life)
    episodes = EpisodeDriver(bus, subjects, gen, cfg, publisher=publisher, status=status, life=life)
    # drafter "model" / "model+group" follow the speculator's draft versions; the "static" ones never do.
    drafts = WeightFollower(bus, subjects.weights(draft_model_name(run_cfg.model_name)), gen, status,
                            run_dir=run_cfg.run_dir, followed=followed_draft(backend)) \
        if cfg.speculative.drafter in ONLINE_DRAFTERS else None
    status.beat.extra = lambda: {**gen.metrics(), **episodes.metrics(), **(drafts.metrics() if drafts else {})}
    driver = BatchDriver(bus, subjects, gen, cfg, intake=intake, weights=weights, publisher=publisher, status=status,
                         life=life, slowdown=SlowdownFile(cfg.slowdown_file), episodes=episodes)
    log.info("generator_ready", backend=cfg.backend, pools=train_pools + eval_pools, boot=gen.boot)
    workers = [lambda: status.beat.loop(life), weights.follow, control.follow, driver.loop, episodes.loop]
    if drafts is not None:
        workers.append(drafts.follow)
    if chat is not None:
        workers.append(lambda: chat.serve(cfg.openai.host, cfg.openai_port, life))
    await run_until_stopped(life, *workers)


def chat_endpoint(bus: Bus, subjects: Subjects, gen: Generator, run_cfg: RunSettings, cfg: GeneratorSettings,
                  train_pools: list[str]) -> Any:
    """The OpenAI-compatible endpoint (services/chat) on this generator's backend, sampling under its
    model lock like the batch sampler and the episode engine."""
    from rlbus.services.chat.server import ChatEndpoint
    from rlbus.services.policy.load import load_tokenizer

    tokenizer = load_tokenizer(run_cfg.model_path)
    return ChatEndpoint(bus, subjects, gen.backend, tokenizer, model_lock=gen.model_lock, model=cfg.openai.model or run_cfg.model_name,
                        generator_id=cfg.instance, options=cfg.openai,
                        default_pool=cfg.openai.pool or (train_pools[0] if train_pools else run_cfg.pools[0]),
                        default_group_size=run_cfg.group_size, seed=cfg.seed)
