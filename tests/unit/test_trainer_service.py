"""The trainer service on the in-memory bus: when a scored group is acked, and what a crash,
a restart and a graceful stop do to it.

What a user cares about: a group is acked only once two checkpoints on disk cover it, the newest
and the one a damaged newest falls back to (else a crash, or a damaged checkpoint, would lose it),
or at a clean end once the final checkpoint is read back intact; a redelivered copy of a group never acks its original early and never enters the
ledger as a "duplicate"; groups dropped while no batch fills are made durable and acked; a
restarted trainer resumes from its checkpoint, acks the committed groups that come back without
training them again, and publishes versions above every one published before; a graceful stop
commits what was trained and gives the rest back.  The heartbeat reports group outcomes per pool
and per generator for the controller's balance accounting.

Every ack is checked when it happens, against the ledgers of the newest checkpoints on disk.  The
policy is a tiny random Qwen2 built here (about a second), not the warm-started ``tiny_model``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlbus.bus.memory import MemoryBus
from rlbus.bus.protocol import ConsumerSpec, Delivery
from rlbus.schemas import Heartbeat, Rollout, ScoredGroup, ScoredRollout, Task, WeightManifest, spans_from_versions
from rlbus.schemas.metric_keys import OUTCOMES, STALE_HELD, TrainerKeys
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle
from rlbus.services.trainer import checkpoint, service
from rlbus.services.trainer.commit import Committer
from rlbus.services.trainer.intake import consumer_spec
from rlbus.services.trainer.settings import TrainerSettings

torch.set_num_threads(1)
RUN = "test"
LOGP = -math.log(78.0)  # about a random policy's logprob over the character vocabulary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Qwen2 with the character tokenizer: a real Hugging Face folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlbus.services.policy.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("policy")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def scored(gid: str, rewards: list[float], *, pool: str = "train", generator: str = "gen-0", version: int = 0,
           invalid: bool = False) -> ScoredGroup:
    rng = np.random.default_rng(abs(hash(gid)) % 2**32)
    prompt = [1, *rng.integers(4, 60, size=5).tolist()]
    rollouts = []
    for i, reward in enumerate(rewards):
        n = 3
        rollout = Rollout(rollout_id=f"{gid}/{i}", task_id=gid, index=i,
                          token_ids=np.array(prompt + rng.integers(4, 60, size=n).tolist(), dtype="<i4"),
                          prompt_len=len(prompt), loss_mask=np.ones(n, dtype="|u1"),
                          behaviour_logprobs=np.full(n, LOGP, dtype="<f4"),
                          version_spans=spans_from_versions(np.full(n, version)), text="", generator_id=generator)
        rollouts.append(ScoredRollout(rollout=rollout, reward=reward, verifier_error="boom" if invalid else ""))
    task = Task(run=RUN, task_id=gid, pool=pool, env="addition", prompt="1+2=", group_size=len(rewards))
    return ScoredGroup(task=task, scored=rollouts, generator_id=generator)


def trainable(gid: str, **kw: Any) -> ScoredGroup:
    return scored(gid, [1.0, 0.0, 0.0, 1.0], **kw)


def filtered(gid: str, **kw: Any) -> ScoredGroup:
    return scored(gid, [1.0, 1.0, 1.0, 1.0], **kw)


# ---- a bus that records every settle, with the ledger on disk at that moment ------------------

# True while the trainer settles at its clean end (``Committer.finish``: graceful stop or max_steps),
# where the verified newest checkpoint alone covers what it acks.
IN_FINISH: contextvars.ContextVar[bool] = contextvars.ContextVar("in_finish", default=False)


@pytest.fixture(autouse=True)
def mark_the_clean_end(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Committer.finish

    async def finish(self: Committer) -> None:
        token = IN_FINISH.set(True)  # the settles run in this task, so they see it
        try:
            await real(self)
        finally:
            IN_FINISH.reset(token)

    monkeypatch.setattr(Committer, "finish", finish)


@dataclass
class Settled:
    how: str  # ack | nak | term
    gid: str
    delivery: int  # 1 = first delivery, 2 = first redelivery …
    on_disk: dict[str, str] | None  # the newest checkpoint's ledger when it happened
    on_disk_step: int | None
    fallback: dict[str, str] | None = None  # the ledger of the checkpoint before it (what a damaged newest falls back to)
    running: bool = True  # settled while the trainer ran, not at its clean end (``finish``)


def checkpoint_state(run_dir: Path) -> dict[str, Any] | None:
    """The newest checkpoint's step, version and whole ledger, as the restarted trainer would read them."""
    state = checkpoint.peek_latest(run_dir / "checkpoints")
    if state is None:
        return None
    return {"step": state.step, "version": state.version, "consumed": dict(state.consumed)}


class _RecordingSettle:
    def __init__(self, bus: RecordingBus, inner: Any, gid: str) -> None:
        self.bus, self.inner, self.gid = bus, inner, gid

    def _record(self, how: str, d: Delivery[Any]) -> None:
        kept = [state for _, state in checkpoint.peek_kept(self.bus.run_dir / "checkpoints")]
        newest, before = (kept + [None, None])[:2]
        self.bus.settled.append(Settled(how, self.gid, d.deliveries, dict(newest.consumed) if newest else None,
                                        newest.step if newest else None, dict(before.consumed) if before else None,
                                        running=not IN_FINISH.get()))

    async def ack(self, d: Delivery[Any]) -> None:
        self._record("ack", d)
        if not self.bus.lose_acks:
            await self.inner.ack(d)

    async def nak(self, d: Delivery[Any], delay: float = 0.0) -> None:
        self._record("nak", d)
        await self.inner.nak(d, delay)

    async def term(self, d: Delivery[Any], reason: str) -> None:
        self._record("term", d)
        if not self.bus.lose_acks:
            await self.inner.term(d, reason)

    async def in_progress(self, d: Delivery[Any] | None = None) -> None:
        await self.inner.in_progress(d)

    def __getattr__(self, name: str) -> Any:  # anything else the bus keeps on its settle handle
        return getattr(self.inner, name)


class _RecordingPuller:
    def __init__(self, bus: RecordingBus, inner: Any) -> None:
        self.bus, self.inner = bus, inner

    async def fetch(self, max_msgs: int, timeout: float) -> list[Delivery[Any]]:
        out = await self.inner.fetch(max_msgs, timeout)
        for d in out:
            gid = d.msg.task.task_id
            d._settle = _RecordingSettle(self.bus, d._settle, gid)
            self.bus.fetched.append((gid, d.deliveries))
        return out

    async def pending(self) -> int:
        return await self.inner.pending()  # type: ignore[no-any-return]


class RecordingBus(MemoryBus):
    """The in-memory bus, recording what the trainer pulls and settles.  ``lose_acks`` drops the
    acks (and terms) on their way (a crash right after the checkpoint, before the acks reached the server)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(RUN)
        self.run_dir = run_dir
        self.fetched: list[tuple[str, int]] = []
        self.settled: list[Settled] = []
        self.lose_acks = False

    def puller(self, spec: ConsumerSpec, decode: Callable[[bytes], Any], *, heartbeat: bool = True) -> Any:
        return _RecordingPuller(self, super().puller(spec, decode, heartbeat=heartbeat))

    def acked(self) -> list[str]:
        return [s.gid for s in self.settled if s.how == "ack"]

    def redeliver_held(self, spec: ConsumerSpec) -> None:
        """What the server does once ``ack_wait`` passes without an ack (the memory bus does not
        model it): every delivery still held is delivered again."""
        self._durable(spec).inflight.clear()
        self._notify()

    async def publish_groups(self, *groups: ScoredGroup) -> None:
        for g in groups:
            await self.publish(self.subjects.scored(g.task.pool), g.encode(), msg_id=g.msg_id)


# ---- running the trainer -----------------------------------------------------------------------


def configs(model_dir: Path, run_dir: Path, *, pools: tuple[str, ...] = ("train",), max_staleness: int = 8,
            **trainer: Any) -> tuple[RunSettings, TrainerSettings]:
    run_cfg = RunSettings(run=RUN, model_path=str(model_dir), run_dir=str(run_dir), pools=list(pools), batch_groups=2,
                          group_size=4, max_staleness=max_staleness)
    return run_cfg, TrainerSettings(**{"lr": 1e-3, "fetch_timeout": 0.05, **trainer})


class Trainer:
    """One trainer process: started on the bus, stopped gracefully or crashed."""

    def __init__(self, bus: RecordingBus, run_cfg: RunSettings, cfg: TrainerSettings) -> None:
        self.bus, self.run_cfg, self.cfg = bus, run_cfg, cfg
        self.life = Lifecycle()
        self.task = asyncio.create_task(service.run(run_cfg, cfg, bus=bus, life=self.life))

    async def heartbeat(self) -> Heartbeat | None:
        raw = await self.bus.last(self.bus.subjects.metrics("trainer", self.cfg.instance))
        return Heartbeat.decode(raw) if raw is not None else None

    async def until(self, what: str, cond: Callable[[Heartbeat | None], bool], timeout: float = 30.0) -> Heartbeat:
        deadline = time.monotonic() + timeout
        while True:
            if self.task.done():
                self.task.result()  # raises what the trainer raised
                raise AssertionError(f"the trainer stopped before {what}")
            hb = await self.heartbeat()
            if cond(hb):
                assert hb is not None
                return hb
            assert time.monotonic() < deadline, f"no {what} within {timeout} s; last heartbeat: {hb}"
            await asyncio.sleep(0.02)

    async def at_step(self, step: int) -> Heartbeat:
        return await self.until(f"step {step}", lambda hb: hb is not None and hb.metrics.get(TrainerKeys.STEP) == step)

    async def stop(self) -> None:
        self.life.shutdown()
        await asyncio.wait_for(self.task, 30)

    async def crash(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def until(what: str, cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        await asyncio.sleep(0.02)


def uploads(bus: MemoryBus) -> list[WeightManifest]:
    subject = bus.subjects.weight_uploads("policy")
    return [WeightManifest.decode(data) for s, data in bus.messages("UPLOADS") if s == subject]


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), …]}`` of the event files in ``folder``, read as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_resumed_board_sorts_after_its_predecessor_made_in_the_same_second(tmp_path: Path) -> None:
    """TensorBoard reads event files in name order and names compare as text: a predecessor whose
    per-process counter is 99 sorts after a successor's 1 made in the same second, and the successor's
    purge would be read first and undo nothing.  The successor waits for the next second instead."""
    import os
    import socket
    import time

    from rlbus.services.trainer.board import EVENT_FILE_PREFIX, StepBoard

    first = StepBoard(tmp_path)
    for step in (1, 2, 3):
        first.write(step, {"v": float(step)})
    first.close()
    (made,) = tmp_path.glob(EVENT_FILE_PREFIX + "*")
    made.rename(tmp_path / f"{EVENT_FILE_PREFIX}{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.99")
    second = StepBoard(tmp_path, resumed_at=2)
    second.write(3, {"v": 30.0})
    second.close()
    assert tensorboard_scalars(tmp_path)["v"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def assert_every_ack_covered(bus: RecordingBus) -> None:
    """An ack (or term) only once the newest checkpoint on disk records the group, never as a
    duplicate; while the trainer runs, only once the checkpoint before it records it too (a
    damaged newest checkpoint falls back to it: an acked group it lacks would be lost)."""
    for s in bus.settled:
        if s.how in ("ack", "term"):
            assert s.on_disk is not None and s.gid in s.on_disk, f"{s.gid} settled before a checkpoint covered it: {s}"
            if s.running:
                assert s.fallback is not None and s.gid in s.fallback, (
                    f"{s.gid} settled while only the newest checkpoint covered it: {s}")
        assert s.on_disk is None or "duplicate" not in s.on_disk.values(), s


# ---- tests -------------------------------------------------------------------------------------


async def test_groups_are_acked_only_once_a_checkpoint_covers_them(model_dir: Path, tmp_path: Path) -> None:
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=2, max_steps=4)
    await bus.publish_groups(trainable("t0"), trainable("t1"), filtered("f0"),
                             *(trainable(f"t{i}") for i in range(2, 8)))
    trainer = Trainer(bus, run_cfg, cfg)
    hb = await trainer.until("done", lambda hb: hb is not None and hb.state == "done")
    board = tensorboard_scalars(tmp_path / "tensorboard")  # readable while it runs: flushed at each step
    await trainer.stop()

    # TensorBoard has every step, each with the values its heartbeat carried (the metrics.jsonl row).
    assert [step for step, _ in board["batch/reward_mean"]] == [1, 2, 3, 4]
    for tag in ("batch/reward_mean", "mismatch/k3_kl", "train/grad_norm", "staleness/mean", TrainerKeys.VERSION):
        assert board[tag][-1] == (4, pytest.approx(hb.metrics[tag], rel=1e-6, abs=1e-12)), tag
    assert_every_ack_covered(bus)
    assert sorted(bus.acked()) == sorted(["f0", *(f"t{i}" for i in range(8))])  # each once
    # Nothing is acked before the second checkpoint (step 4), though step 2 was checkpointed: steps
    # 1-2's groups once step 4's checkpoint exists, steps 3-4's at the clean end (max_steps), once
    # step 4's checkpoint is read back intact.
    assert {s.on_disk_step for s in bus.settled} == {4}
    assert sorted(s.gid for s in bus.settled if s.running) == ["f0", "t0", "t1", "t2", "t3"]
    state = checkpoint_state(tmp_path)
    assert state is not None and state["step"] == 4
    assert state["consumed"] == {"f0": "filtered", **{f"t{i}": "train" for i in range(8)}}
    assert [m.version for m in uploads(bus)] == [1, 2, 3, 4]  # one per step, in order
    assert hb.metrics[TrainerKeys.GROUPS_TRAINED_TOTAL] == 8


async def test_a_redelivered_duplicate_waits_for_its_original_and_never_enters_the_ledger(
        model_dir: Path, tmp_path: Path) -> None:
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=1, max_steps=1)
    spec = consumer_spec(run_cfg, cfg, bus.subjects)
    await bus.publish_groups(trainable("t0"))
    trainer = Trainer(bus, run_cfg, cfg)
    await until("t0 pulled", lambda: ("t0", 1) in bus.fetched)
    # t0 waits for a batch; ack_wait passes twice: two copies arrive while the original is held.
    bus.redeliver_held(spec)
    await until("a first copy", lambda: ("t0", 2) in bus.fetched)
    bus.redeliver_held(spec)
    await until("a second copy", lambda: ("t0", 3) in bus.fetched)
    # Two drops make a ledger-only save (batch_groups = 2): it must not ack the copies, which
    # would ack the original message that still waits, uncommitted, for its batch.
    await until("the ledger-only save", lambda: checkpoint_state(tmp_path) is not None)
    await asyncio.sleep(0.2)
    assert bus.acked() == []
    assert checkpoint_state(tmp_path)["consumed"] == {}  # type: ignore[index]

    await bus.publish_groups(trainable("t1"))
    await trainer.until("done", lambda hb: hb is not None and hb.state == "done")
    await trainer.stop()
    assert_every_ack_covered(bus)
    assert sorted((s.gid, s.delivery) for s in bus.settled if s.how == "ack") == [
        ("t0", 1), ("t0", 2), ("t0", 3), ("t1", 1)]
    assert checkpoint_state(tmp_path)["consumed"] == {"t0": "train", "t1": "train"}  # type: ignore[index]


async def test_dropped_groups_are_made_durable_by_a_ledger_only_save_and_acked(model_dir: Path, tmp_path: Path) -> None:
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=2)
    await bus.publish_groups(*(trainable(f"t{i}") for i in range(10)))
    trainer = Trainer(bus, run_cfg, cfg)
    await trainer.at_step(5)  # checkpoints at steps 2 and 4; step 5 (t8, t9) is not in one yet
    await bus.publish_groups(filtered("f0"), filtered("f1"))  # no batch fills: every reward equal
    await until("the dropped groups acked", lambda: {"f0", "f1"} <= set(bus.acked()))
    await trainer.stop()

    assert_every_ack_covered(bus)  # the step-2 checkpoint, which step 4's falls back to, has them too
    drops = [s for s in bus.settled if s.gid in ("f0", "f1")]
    # Added to the step-4 checkpoint's ledger, which must not claim step 5's groups: its model
    # does not have their update, so a crash would lose them; and to step 2's, not claiming step 3-4's.
    assert all(s.on_disk_step == 4 and s.running for s in drops)
    assert drops[0].on_disk == {**{f"t{i}": "train" for i in range(8)}, "f0": "filtered", "f1": "filtered"}
    assert drops[0].fallback == {**{f"t{i}": "train" for i in range(4)}, "f0": "filtered", "f1": "filtered"}
    # The graceful stop then committed step 5.
    state = checkpoint_state(tmp_path)
    assert state is not None and state["step"] == 5 and state["consumed"]["t9"] == "train"
    assert state["consumed"]["f1"] == "filtered"


async def test_drops_recorded_with_steps_are_settled_without_waiting_for_checkpoints(model_dir: Path,
                                                                                       tmp_path: Path) -> None:
    """Groups dropped while a batch fills are recorded with its step; were they held for two
    checkpoints like trained groups, a run that drops most groups (a nearly solved task) would fill
    the durable's max_ack_pending and deadlock (no delivery, so no step, so no checkpoint, so no
    ack). They are settled once a batch's worth is held, through a ledger-only save (or, before two
    checkpoints exist, a full one), while the trainer runs, each covered by two checkpoints."""
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=50, max_steps=6)
    # Each batch fills with a drop among its groups: one drop is too few for the drops-only save
    # intake makes while no batch fills (batch_groups = 2), so it is recorded with the step.
    for i in range(6):
        await bus.publish_groups(trainable(f"a{i}"), filtered(f"f{i}"), trainable(f"b{i}"))
    trainer = Trainer(bus, run_cfg, cfg)
    await trainer.until("done", lambda hb: hb is not None and hb.state == "done")
    await trainer.stop()

    assert_every_ack_covered(bus)
    drops = {s.gid for s in bus.settled if s.gid.startswith("f") and s.running}
    # No checkpoint was due (checkpoint_every = 50): without the settling, every drop would still
    # be held at the clean end. At most a batch's worth (2) may be left for it.
    assert len(drops) >= 4, sorted(drops)
    state = checkpoint_state(tmp_path)
    assert state is not None and state["step"] == 6
    assert state["consumed"] == {**{f"f{i}": "filtered" for i in range(6)},
                                 **{f"{k}{i}": "train" for i in range(6) for k in "ab"}}
    assert sorted(bus.acked()) == sorted(state["consumed"])  # everything settled once


async def test_a_restarted_trainer_resumes_and_does_not_train_committed_groups_again(
        model_dir: Path, tmp_path: Path) -> None:
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=2, max_steps=4)
    spec = consumer_spec(run_cfg, cfg, bus.subjects)
    bus.lose_acks = True  # the first trainer dies after each checkpoint, before its acks arrive
    await bus.publish_groups(*(trainable(f"t{i}") for i in range(6)))
    first = Trainer(bus, run_cfg, cfg)
    await first.at_step(3)
    # The heartbeat names step 3 as soon as it is trained; its upload follows on its own task.
    await until("version 3 uploaded", lambda: any(m.version == 3 for m in uploads(bus)))
    # weight-broadcast has published the first trainer's newest version, 3.
    newest = dataclasses.replace(uploads(bus)[-1], state="published")
    assert newest.version == 3
    await bus.publish(bus.subjects.weights("policy"), newest.encode(), msg_id=newest.msg_id)
    await first.crash()
    bus.redeliver_held(spec)  # t0..t3 (committed) and t4, t5 (trained at step 3, never committed)
    bus.lose_acks = False
    await bus.publish_groups(trainable("t6"), trainable("t7"))

    before = len(bus.settled)
    second = Trainer(bus, run_cfg, cfg)
    hb = await second.until("done", lambda hb: hb is not None and hb.state == "done")
    await second.stop()
    assert_every_ack_covered(bus)
    assert sorted(s.gid for s in bus.settled[before:] if s.how == "ack") == [f"t{i}" for i in range(8)]
    # It resumed at step 2 and trained t4..t7 only: the committed t0..t3 came back as duplicates.
    assert hb.metrics[TrainerKeys.groups("train")] == 4 and hb.metrics[TrainerKeys.groups("duplicate")] == 4
    assert hb.metrics[TrainerKeys.GROUPS_TRAINED_TOTAL] == 8  # 4 from the checkpoint + 4
    state = checkpoint_state(tmp_path)
    assert state is not None and state["step"] == 4
    assert state["consumed"] == {f"t{i}": "train" for i in range(8)}
    # Versions continue after the newest published one: the resumed weights become 4, then 5, 6.
    versions = [m.version for m in uploads(bus)]
    assert versions == [1, 2, 3, 4, 5, 6]
    assert hb.metrics[TrainerKeys.VERSION] == 6
    # TensorBoard shows each step once: the crashed trainer's step 3 (version 3) is hidden by the step 3
    # trained again from the checkpoint (version 5).
    board = tensorboard_scalars(tmp_path / "tensorboard")
    assert board[TrainerKeys.VERSION] == [(1, 1), (2, 2), (3, 5), (4, 6)]


async def test_a_graceful_stop_commits_what_was_trained_and_gives_back_the_rest(
        model_dir: Path, tmp_path: Path) -> None:
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=100)
    spec = consumer_spec(run_cfg, cfg, bus.subjects)
    await bus.publish_groups(trainable("t0"), trainable("t1"), trainable("t2"), filtered("f0"))
    trainer = Trainer(bus, run_cfg, cfg)
    await trainer.at_step(1)
    await bus.publish_groups(filtered("f1"))
    await until("f1 pulled", lambda: ("f1", 1) in bus.fetched)
    assert bus.acked() == []  # checkpoint_every = 100: nothing is durable yet
    await trainer.stop()

    assert_every_ack_covered(bus)
    assert sorted(bus.acked()) == ["f0", "t0", "t1"]  # step 1 and the drop it recorded
    assert sorted(s.gid for s in bus.settled if s.how == "nak") == ["f1", "t2"]  # held for the next batch
    state = checkpoint_state(tmp_path)
    assert state is not None and state["step"] == 1
    assert [m.version for m in uploads(bus)] == [1]
    hb = await trainer.heartbeat()
    assert hb is not None and hb.state == "stopped"
    # What was given back is delivered again at once.
    again = await bus.puller(spec, ScoredGroup.decode).fetch(10, timeout=1.0)
    assert sorted((d.msg.task.task_id, d.deliveries) for d in again) == [("f1", 2), ("t2", 2)]


async def test_the_heartbeat_reports_group_outcomes_per_pool_and_per_generator(
        model_dir: Path, tmp_path: Path) -> None:
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, pools=("a", "b"), max_staleness=0, checkpoint_every=1)
    await bus.publish_groups(trainable("t0", pool="a", generator="gen-0"), trainable("t1", pool="a", generator="gen-1"),
                             trainable("t2", pool="b", generator="gen-1"),  # held, stale once version 1 exists
                             filtered("f0", pool="a", generator="gen-0"),
                             scored("i0", [1.0, 0.0], pool="b", generator="gen-0", invalid=True))
    trainer = Trainer(bus, run_cfg, cfg)
    await trainer.at_step(1)
    await bus.publish_groups(trainable("s0", pool="b", generator="gen-1", version=0))  # late: stale on arrival
    b_stale = TrainerKeys.pool_groups("b", "stale")
    hb = await trainer.until("s0 judged", lambda hb: hb is not None and hb.metrics.get(b_stale) == 2)
    await trainer.stop()

    m = hb.metrics
    expected = {("pool", "a"): {"train": 2, "filtered": 1},
                ("pool", "b"): {"invalid": 1, "stale": 2, STALE_HELD: 1},
                ("generator", "gen-0"): {"train": 1, "filtered": 1, "invalid": 1},
                ("generator", "gen-1"): {"train": 1, "stale": 2, STALE_HELD: 1}}
    seen: dict[tuple[str, str], dict[str, float]] = {}
    for key, value in m.items():
        parsed = TrainerKeys.parse_breakdown(key)
        if parsed is not None:
            seen.setdefault(parsed[:2], {})[parsed[2]] = value
    for where, counts in expected.items():
        assert seen[where] == {o: counts.get(o, 0) for o in (*OUTCOMES, STALE_HELD)}, where
    assert set(seen) == set(expected)
    assert m[TrainerKeys.groups("stale")] == 2 and m[TrainerKeys.groups(STALE_HELD)] == 1
    assert m[TrainerKeys.groups("train")] == 2
    assert m[TrainerKeys.IDLE_S] > 0  # waited for t2's batch partner, which never came in time
    # Every name the controller and `rlbus status` read from a trainer heartbeat is emitted.
    named = {getattr(TrainerKeys, k) for k in vars(TrainerKeys) if k.isupper()}
    assert named <= set(m), sorted(named - set(m))


async def test_groups_of_the_running_step_count_as_consumed_and_no_ledger_is_written_during_it(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbus.services.trainer.policy import TrainedPolicy

    started, release = threading.Event(), threading.Event()
    real_step = TrainedPolicy.train_step

    def slow_first_step(self: TrainedPolicy, seqs: Any) -> dict[str, float]:
        if not started.is_set():
            started.set()
            assert release.wait(30), "the test never released the step"
        return real_step(self, seqs)

    monkeypatch.setattr(TrainedPolicy, "train_step", slow_first_step)
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=1, max_steps=2)
    spec = consumer_spec(run_cfg, cfg, bus.subjects)
    await bus.publish_groups(trainable("t0"), trainable("t1"))
    trainer = Trainer(bus, run_cfg, cfg)
    try:
        await until("step 1 running", started.is_set)
        bus.redeliver_held(spec)  # t0 and t1 come back while step 1 trains on them
        await until("the copies pulled", lambda: {("t0", 2), ("t1", 2)} <= set(bus.fetched))
        await bus.publish_groups(filtered("f0"), filtered("f1"))
        # Were the copies taken for new groups, they would fill the next batch and stop the pulls.
        await until("the drops pulled beside the copies", lambda: {("f0", 1), ("f1", 1)} <= set(bus.fetched),
                    timeout=5.0)
        await asyncio.sleep(0.2)
        assert checkpoint_state(tmp_path) is None  # four drops, but the step is changing the model
    finally:
        release.set()
    await trainer.at_step(1)
    await bus.publish_groups(trainable("t2"), trainable("t3"))
    hb = await trainer.until("done", lambda hb: hb is not None and hb.state == "done")
    await trainer.stop()

    assert_every_ack_covered(bus)
    assert hb.metrics[TrainerKeys.groups("duplicate")] == 2  # t0, t1 were not trained twice
    assert hb.metrics[TrainerKeys.GROUPS_TRAINED_TOTAL] == 4
    state = checkpoint_state(tmp_path)
    assert state is not None and state["consumed"] == {"t0": "train", "t1": "train", "t2": "train", "t3": "train",
                                                       "f0": "filtered", "f1": "filtered"}
    assert sorted(bus.acked()) == ["f0", "f1", "t0", "t0", "t1", "t1", "t2", "t3"]
