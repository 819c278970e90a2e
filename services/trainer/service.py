"""trainer service — GRPO steps on scored groups, within the staleness bound, crash-safe.

consumes:  rl.<run>.scored.<pool>   (ScoredGroup)  durable 'trainer', explicit ack after the
                                                   checkpoint of the step that used it is durable
produces:  rl.<run>.weights.<model>.upload  (WeightManifest state=uploaded)  msg id 'upload.<model>.v<N>'
           rl.<run>.metrics.trainer.<instance>  (Heartbeat) per step: loss, mismatch, staleness, idle
waits for: a full batch of ``batch_groups`` informative, fresh groups
unblocked by: generators (via reward) producing within the controller's admission
Order of effects per step: train -> checkpoint (fsync) -> upload weights -> ack every message the
step consumed or dropped.  A crash anywhere redelivers; the checkpoint's consumed ids turn the
redeliveries into acks without training twice.
"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from bus.protocol import Bus, ConsumerSpec
from bus.subjects import Subjects
from observability.logging import get_logger
from schemas import ScoredGroup, TensorMeta, WeightManifest
from services.policy.load import load_policy
from services.runtime.config import RunSettings
from services.runtime.heartbeat import Beat
from services.runtime.lifecycle import Lifecycle
from services.runtime.weights import make_transport
from services.trainer import checkpoint
from services.trainer.batch import Assembler, GroupDecision
from services.trainer.settings import TrainerSettings
from services.trainer.step import pack, train_step

log = get_logger()


def weights_bytes(model: torch.nn.Module) -> tuple[bytes, list[TensorMeta]]:
    # Every named parameter is sent explicitly (lm_head too): an engine with tied embeddings
    # would otherwise keep a stale output layer.
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    metas = [TensorMeta(name=k, dtype=str(v.dtype).removeprefix("torch."), shape=list(v.shape)) for k, v in state.items()]
    return save_safetensors(state), metas


async def run(run_cfg: RunSettings, cfg: TrainerSettings, *, bus: Bus, life: Lifecycle) -> None:
    subjects = Subjects(run_cfg.run)
    run_dir = Path(run_cfg.run_dir)
    model, _ = await asyncio.to_thread(load_policy, run_cfg.model_path, dtype=cfg.dtype,
                                       attn="eager" if cfg.deterministic else "sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    ref_model = copy.deepcopy(model).eval() if cfg.kl_coef > 0 else None
    ckpt_dir = run_dir / "checkpoints"
    state = await asyncio.to_thread(checkpoint.load_latest, ckpt_dir, model, optimizer) or checkpoint.TrainerState()
    transport = make_transport(cfg.transport, bus=bus, root=run_dir)
    beat = Beat(bus, subjects, "trainer", cfg.instance, period=1.0)
    asm = Assembler(batch_groups=run_cfg.batch_groups, max_staleness=run_cfg.max_staleness)
    counters = {"groups_trained_total": 0.0, "groups_dropped_total": 0.0, "rollouts_stale_total": 0.0,
                "idle_s": 0.0, "busy_s": 0.0, **state.counters}
    beat.version = state.version
    if state.step:
        log.info("trainer_resumed", step=state.step, version=state.version, consumed=len(state.consumed))

    def publish_state(extra: dict[str, float] | None = None) -> None:
        total = counters["idle_s"] + counters["busy_s"]
        beat.metrics.update({"trainer/version": state.version, "trainer/step": state.step,
                             "trainer/groups_trained_total": counters["groups_trained_total"],
                             "trainer/groups_dropped_total": counters["groups_dropped_total"],
                             "trainer/rollouts_stale_total": counters["rollouts_stale_total"],
                             "trainer/idle_fraction": counters["idle_s"] / total if total else 0.0,
                             "trainer/pending_groups": len(asm.kept)})
        for reason, n in asm.counts.items():
            beat.metrics[f"trainer/groups_{reason}"] = n
        if extra:
            beat.metrics.update(extra)

    async def upload(version: int) -> float:
        t0 = time.perf_counter()
        data, metas = await asyncio.to_thread(weights_bytes, model)
        shard = await transport.write(f"weights/{run_cfg.model_name}/v{version:08d}/model.safetensors", data)
        manifest = WeightManifest(model=run_cfg.model_name, version=version, transport=cfg.transport, shards=[shard],
                                  tensors=metas, trainer_step=state.step, created_at=time.time(), state="uploaded")
        await bus.publish(subjects.weight_uploads(run_cfg.model_name), manifest.encode(),
                          msg_id=f"upload.{run_cfg.model_name}.v{version}")
        return time.perf_counter() - t0

    if state.step:
        await upload(state.version)  # idempotent (msg id): covers a crash between checkpoint and upload

    pools = [p for p in run_cfg.pools if p != run_cfg.eval_pool]
    window = run_cfg.admission_window_groups
    spec = ConsumerSpec(stream="SCORED", durable=subjects.durable("trainer"),
                        filter_subjects=tuple(subjects.scored(p) for p in pools), ack_wait=cfg.ack_wait, max_deliver=10,
                        max_ack_pending=max(8 * window, 512))
    puller = bus.puller(spec, ScoredGroup.decode)

    async def settle(decisions: list[GroupDecision]) -> None:
        for d in decisions:
            await d.handle.ack()

    async def keep_alive() -> None:
        """Held messages outlive ack_wait while a batch fills or a step runs: heartbeat them."""
        while not await life.sleep(spec.ack_wait / 3):
            for d in [*asm.kept, *asm.dropped]:
                await d.handle.in_progress()

    async def commit_dropped() -> None:
        """Many groups dropped and no batch yet (e.g. every reward equal): make their ledger
        entries durable and ack them, instead of holding them against max_ack_pending."""
        dropped = asm.dropped
        asm.dropped = []
        for d in dropped:
            state.consumed.setdefault(d.group.task.task_id, d.reason)
        state.counters = counters
        await asyncio.to_thread(checkpoint.save_ledger, ckpt_dir, model, optimizer, state, keep=cfg.checkpoint_keep)
        await settle(dropped)
        publish_state()

    async def loop() -> None:
        while not life.stopping.is_set():
            if cfg.max_steps and state.step >= cfg.max_steps:
                beat.state = "done"
                await life.sleep(1.0)
                continue
            t_wait = time.perf_counter()
            while not asm.full and not life.stopping.is_set():
                got = await puller.fetch(max(run_cfg.batch_groups - len(asm.kept), 1) * 2, timeout=cfg.fetch_timeout)
                for d in got:
                    decision = asm.offer(d.msg, d, version=state.version, consumed=state.consumed.keys())
                    if decision.reason not in ("train", "duplicate"):
                        # Frees admission budget now; the ack still waits for the next checkpoint.
                        counters["groups_dropped_total"] += 1
                if len(asm.dropped) >= run_cfg.batch_groups:
                    await commit_dropped()
                if not got:
                    publish_state()
            counters["idle_s"] += time.perf_counter() - t_wait
            if life.stopping.is_set():
                break
            batch, dropped = asm.take()
            t_busy = time.perf_counter()
            seqs, batch_stats = pack(batch, cfg)
            metrics = await asyncio.to_thread(train_step, model, optimizer, seqs, cfg, ref_model)
            state.step += 1
            state.version += 1
            for d in batch:
                state.consumed[d.group.task.task_id] = "train"
            for d in dropped:
                state.consumed.setdefault(d.group.task.task_id, d.reason)
            counters["groups_trained_total"] += len(batch)
            counters["rollouts_stale_total"] = asm.rollouts_stale
            state.counters = counters
            t_ckpt = time.perf_counter()
            await asyncio.to_thread(checkpoint.save, ckpt_dir, model, optimizer, state, keep=cfg.checkpoint_keep)
            ckpt_s = time.perf_counter() - t_ckpt
            upload_s = await upload(state.version)
            await settle(batch + dropped)
            # Groups held for the next batch may have aged past the bound with this version.
            counters["groups_dropped_total"] += len(asm.requeue_stale(state.version))
            counters["busy_s"] += time.perf_counter() - t_busy
            metrics.update(batch_stats)
            metrics.update({"time/checkpoint_s": ckpt_s, "time/weight_upload_s": upload_s,
                            "time/step_total_s": time.perf_counter() - t_busy})
            publish_state({k if "/" in k else f"train/{k}": float(v) for k, v in metrics.items()})
            beat.version = state.version
            await beat.send()  # one heartbeat per step carries that step's metrics
            log.info("step", step=state.step, version=state.version, reward=round(batch_stats["batch/reward_mean"], 3),
                     k3=round(metrics.get("mismatch/k3_kl", 0.0), 6), step_s=round(metrics["train/step_s"], 3))

    beat.state = "running"
    publish_state()

    async def heartbeats() -> None:
        await beat.loop(life)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(heartbeats())
            tg.create_task(keep_alive())
            tg.create_task(loop())
    finally:
        # Unused held messages go back now rather than after ack_wait.
        for d in [*asm.kept, *asm.dropped]:
            try:
                await d.handle.nak()
            except Exception as exc:  # the connection may already be gone
                log.warning("nak_on_shutdown_failed", error=repr(exc))
