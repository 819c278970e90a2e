"""trainer service — GRPO steps on scored groups, within the staleness bound, crash-safe.

consumes:  rl.<run>.scored.<pool>   (ScoredGroup)  durable 'trainer', explicit ack after the
                                                   checkpoint covering the step that used it
produces:  rl.<run>.weights.<model>.upload  (WeightManifest state=uploaded)  msg id 'upload.<model>.v<N>'
           rl.<run>.metrics.trainer.<instance>  (Heartbeat) per step: loss, mismatch, staleness, idle
waits for: a full batch of ``batch_groups`` informative, fresh groups
unblocked by: generators (via reward) producing within the controller's admission
Per step: train -> hand the weights to weight-broadcast (in the background, in order).  Every
``checkpoint_every`` steps: checkpoint (fsync) -> ack every message consumed or dropped since the
last one.  A crash redelivers what was not checkpointed; the checkpoint's consumed ids turn
redeliveries of committed groups into acks, so no group is trained twice in the surviving model.
Versions are a monotonic identity of published weights: a resumed trainer continues after the
newest version ever published, so a number never names two different sets of weights.
Under torchrun (``[trainer] distributed``) this is rank 0; the other ranks only follow its
steps and state gathers (distributed.py).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time
from collections.abc import Container
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from bus.protocol import Bus, ConsumerSpec, Delivery
from bus.subjects import Subjects
from observability.logging import get_logger
from schemas import ScoredGroup, TensorMeta, WeightManifest
from services.policy.load import load_policy
from services.runtime.config import RunSettings
from services.runtime.heartbeat import Beat
from services.runtime.lifecycle import Lifecycle
from services.runtime.weights import make_transport
from services.trainer import checkpoint, distributed
from services.trainer.batch import Assembler, GroupDecision, ledger_entries, ready_to_ack
from services.trainer.settings import TrainerSettings
from services.trainer.step import PackedSeq, make_optimizer, pack, train_step

log = get_logger()


class _Either:
    """Membership in either of two containers, without copying a growing ledger."""

    def __init__(self, a: Container[str], b: Container[str]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b


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
    ref_model = copy.deepcopy(model).eval() if cfg.kl_coef > 0 else None
    optimizer: torch.optim.Optimizer
    sharded: distributed.ShardedPolicy | None = None
    if distributed.backend_for(cfg.distributed) is not None:
        # Under torchrun: rank 0 is this service; the other ranks only take part in steps and
        # state gathers, on rank 0's command, until it stops them (see distributed.py).
        sharded = await asyncio.to_thread(distributed.ShardedPolicy.join, model, cfg, ref_model)
        if sharded.rank > 0:
            await asyncio.to_thread(sharded.follow)
            return
        # Stand-ins that gather/scatter the full state over every rank: checkpoint and
        # weights_bytes use nothing but state_dict()/load_state_dict() of a model or optimizer.
        model, optimizer = sharded.model_view, sharded.optimizer_view  # type: ignore[assignment]
        step_fn = sharded.train_step
    else:
        optimizer = make_optimizer(model, cfg)
        step_fn = functools.partial(train_step, model, optimizer, cfg=cfg, ref_model=ref_model)
    ckpt_dir = run_dir / "checkpoints"
    state = await asyncio.to_thread(checkpoint.load_latest, ckpt_dir, model, optimizer) or checkpoint.TrainerState()
    transport = make_transport(cfg.transport, bus=bus, root=run_dir)
    beat = Beat(bus, subjects, "trainer", cfg.instance, period=1.0)
    asm = Assembler(batch_groups=run_cfg.batch_groups, max_staleness=run_cfg.max_staleness)
    counters = {"groups_trained_total": 0.0, "groups_dropped_total": 0.0, "rollouts_stale_total": 0.0,
                "idle_s": 0.0, "busy_s": 0.0, **state.counters}
    latest_raw = await bus.last(subjects.weights(run_cfg.model_name))
    published = WeightManifest.decode(latest_raw).version if latest_raw is not None else 0
    resumed = state.step > 0 or published > state.version
    state.version = max(state.version, published)
    beat.version = state.version
    if resumed:
        log.info("trainer_resumed", step=state.step, version=state.version, consumed=len(state.consumed))
    unacked: list[GroupDecision] = []  # consumed or dropped since the last checkpoint

    def publish_state(extra: dict[str, float] | None = None) -> None:
        total = counters["idle_s"] + counters["busy_s"]
        beat.metrics.update({"trainer/version": state.version, "trainer/step": state.step,
                             "trainer/groups_trained_total": counters["groups_trained_total"],
                             "trainer/groups_dropped_total": counters["groups_dropped_total"],
                             "trainer/rollouts_stale_total": counters["rollouts_stale_total"],
                             "trainer/idle_fraction": counters["idle_s"] / total if total else 0.0,
                             "trainer/pending_groups": len(asm.kept), "trainer/unacked_groups": len(unacked)})
        for reason, n in asm.counts.items():
            beat.metrics[f"trainer/groups_{reason}"] = n
        if extra:
            beat.metrics.update(extra)

    async def upload(version: int, data: bytes, metas: list[TensorMeta], step: int) -> float:
        t0 = time.perf_counter()
        shard = await transport.write(f"weights/{run_cfg.model_name}/v{version:08d}/model.safetensors", data)
        manifest = WeightManifest(model=run_cfg.model_name, version=version, transport=cfg.transport, shards=[shard],
                                  tensors=metas, trainer_step=step, created_at=time.time(), state="uploaded")
        await bus.publish(subjects.weight_uploads(run_cfg.model_name), manifest.encode(), msg_id=manifest.msg_id)
        return time.perf_counter() - t0

    uploading: asyncio.Task[float] | None = None
    last_upload_s = 0.0

    async def hand_over_weights() -> None:
        """Snapshot now; upload in the background, one at a time, in version order."""
        nonlocal uploading, last_upload_s
        data, metas = await asyncio.to_thread(weights_bytes, model)
        if uploading is not None:
            last_upload_s = await uploading
        uploading = asyncio.create_task(upload(state.version, data, metas, state.step))

    if resumed:
        # Generators may hold weights of steps lost with the crash: move them to this lineage.
        state.version += 1
        await hand_over_weights()

    pools = [p for p in run_cfg.pools if p != run_cfg.eval_pool]
    window = run_cfg.admission_window_groups
    # Held un-acked: up to checkpoint_every batches plus what waits for the next batch.
    max_ack_pending = (cfg.checkpoint_every + 2 * (run_cfg.max_staleness + 1) + 2) * run_cfg.batch_groups + 512
    spec = ConsumerSpec(stream="SCORED", durable=subjects.durable("trainer"),
                        filter_subjects=tuple(subjects.scored(p) for p in pools), ack_wait=cfg.ack_wait, max_deliver=10,
                        max_ack_pending=max(max_ack_pending, 8 * window))
    puller = bus.puller(spec, ScoredGroup.decode)

    async def commit() -> float:
        """Checkpoint, then ack everything it covers.  Returns the checkpoint seconds."""
        t0 = time.perf_counter()
        state.counters = counters
        await asyncio.to_thread(checkpoint.save, ckpt_dir, model, optimizer, state, keep=cfg.checkpoint_keep)
        spent = time.perf_counter() - t0
        done, unacked[:] = ready_to_ack(unacked, state.consumed)
        for d in done:
            await d.handle.ack()
        return spent

    async def commit_dropped() -> None:
        """Many groups dropped and no batch yet (e.g. every reward equal): make their ledger
        entries durable and ack them, instead of holding them against max_ack_pending."""
        dropped, asm.dropped = asm.dropped, []
        entries = ledger_entries(dropped)
        for gid, reason in entries.items():
            state.consumed.setdefault(gid, reason)
        state.counters = counters
        await asyncio.to_thread(checkpoint.save_ledger, ckpt_dir, model, optimizer, state, keep=cfg.checkpoint_keep,
                                dropped=entries)
        # A ledger-only save commits no trained group: duplicates wait for the next commit().
        now, later = ready_to_ack(dropped, committed=())
        unacked.extend(later)
        for d in now:
            await d.handle.ack()
        publish_state()

    async def keep_alive() -> None:
        """Held messages outlive ack_wait while a batch fills or a step runs: heartbeat them."""
        while not await life.sleep(spec.ack_wait / 3):
            for d in [*asm.kept, *asm.dropped, *unacked]:
                await d.handle.in_progress()

    async def absorb(got: list[Delivery[ScoredGroup]], *, consumed: Container[str], may_commit: bool = True) -> None:
        dropped_before = counters["groups_dropped_total"]
        for d in got:
            decision = asm.offer(d.msg, d, version=state.version, consumed=consumed)
            if decision.reason not in ("train", "duplicate"):
                # Frees admission budget now; the ack still waits for the next checkpoint.
                counters["groups_dropped_total"] += 1
        if counters["groups_dropped_total"] > dropped_before:
            # The controller re-admits dropped groups only once it hears of them: tell it now
            # rather than at the next periodic heartbeat, or the trainer idles meanwhile.
            publish_state()
            await beat.send()
        if may_commit and len(asm.dropped) >= run_cfg.batch_groups:
            await commit_dropped()

    async def fill_batch() -> None:
        t_wait = time.perf_counter()
        while not asm.full and not life.stopping.is_set():
            got = await puller.fetch(max(run_cfg.batch_groups - len(asm.kept), 1) * 2, timeout=cfg.fetch_timeout)
            await absorb(got, consumed=state.consumed.keys())
            if not got:
                publish_state()
        counters["idle_s"] += time.perf_counter() - t_wait

    async def step_and_prefetch(seqs: list[PackedSeq], in_step: set[str]) -> dict[str, float]:
        """Run the step in a worker thread and meanwhile take in what arrives for the next batch:
        decoding and judging groups then overlaps the step instead of following it.  Groups of
        the running step count as consumed (a redelivered copy is a duplicate), and no ledger is
        written while the step mutates the model (that waits for ``fill_batch``)."""
        step = asyncio.ensure_future(asyncio.to_thread(step_fn, seqs))
        consumed = _Either(state.consumed.keys(), in_step)
        while not step.done() and not asm.full:
            got = await puller.fetch(run_cfg.batch_groups, timeout=0.05)
            await absorb(got, consumed=consumed, may_commit=False)
            if not got:
                await asyncio.wait([step], timeout=0.05)
        return await step

    async def loop() -> None:
        while not life.stopping.is_set():
            if cfg.max_steps and state.step >= cfg.max_steps:
                if unacked:
                    await commit()
                beat.state = "done"
                await life.sleep(1.0)
                continue
            await fill_batch()
            if life.stopping.is_set():
                break
            batch, dropped = asm.take()
            t_busy = time.perf_counter()
            seqs, batch_stats = pack(batch, cfg)
            metrics = await step_and_prefetch(seqs, {d.group.task.task_id for d in batch})
            state.step += 1
            state.version += 1
            for d in batch:
                state.consumed[d.group.task.task_id] = "train"
            for gid, reason in ledger_entries(dropped).items():
                state.consumed.setdefault(gid, reason)
            unacked.extend(batch + dropped)
            counters["groups_trained_total"] += len(batch)
            counters["rollouts_stale_total"] = asm.rollouts_stale
            await hand_over_weights()
            ckpt_s = await commit() if state.step % cfg.checkpoint_every == 0 else 0.0
            # Groups held for the next batch may have aged past the bound with this version.
            counters["groups_dropped_total"] += len(asm.requeue_stale(state.version))
            counters["busy_s"] += time.perf_counter() - t_busy
            metrics.update(batch_stats)
            metrics.update({"time/checkpoint_s": ckpt_s, "time/weight_upload_s": last_upload_s,
                            "time/step_total_s": time.perf_counter() - t_busy})
            publish_state({k if "/" in k else f"train/{k}": float(v) for k, v in metrics.items()})
            beat.version = state.version
            await beat.send()  # one heartbeat per step carries that step's metrics
            log.info("step", step=state.step, version=state.version, reward=round(batch_stats["batch/reward_mean"], 3),
                     k3=round(metrics.get("mismatch/k3_kl", 0.0), 6), step_s=round(metrics["train/step_s"], 3))

    beat.state = "running"
    publish_state()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(beat.loop(life))
            tg.create_task(keep_alive())
            tg.create_task(loop())
        # Graceful stop: what was trained becomes durable and acked; the rest goes back now.
        if uploading is not None:
            await uploading
        if unacked:
            await commit()
    finally:
        for d in [*asm.kept, *asm.dropped]:
            try:
                await d.handle.nak()
            except Exception as exc:  # the connection may already be gone
                log.warning("nak_on_shutdown_failed", error=repr(exc))
        if sharded is not None:
            await asyncio.to_thread(sharded.close)
