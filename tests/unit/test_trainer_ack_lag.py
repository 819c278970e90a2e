"""A damaged newest checkpoint loses no group: acks lag one checkpoint.

``load_latest`` falls back to the checkpoint before the newest when the newest is damaged.  Had the
trainer acked the groups of the newest as soon as it was saved, the stream would never deliver them
again and the fallback's model never had them: silently lost.  So while the trainer runs, a group
is acked only once the checkpoint before the newest covers it too; at a clean end, only once the
final checkpoint has been read back from the disk intact.  These tests damage checkpoints on disk
the way a disk or an operator would (a flipped byte) and check that every group is trained exactly
once in the surviving model, on the in-memory bus harness of ``test_trainer_service.py``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbus.schemas.metric_keys import TrainerKeys
from rlbus.services.trainer import checkpoint
from rlbus.services.trainer.intake import consumer_spec
from tests.unit.test_trainer_service import (  # noqa: F401 - model_dir, mark_the_clean_end are fixtures
    RecordingBus,
    Trainer,
    assert_every_ack_covered,
    checkpoint_state,
    configs,
    filtered,
    mark_the_clean_end,
    model_dir,
    trainable,
    until,
)

torch.set_num_threads(1)


def flip_the_last_byte(path: Path) -> None:
    """Damage a tensor's data, not the header: the file still parses, with wrong weights."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def damage_the_newest(run_dir: Path) -> None:
    flip_the_last_byte(checkpoint.checkpoints(run_dir / "checkpoints")[0].folder / checkpoint.MODEL)


def trained(gids: range | list[int]) -> dict[str, str]:
    return {f"t{i}": "train" for i in gids}


async def test_a_damaged_newest_checkpoint_loses_no_acked_group_and_its_groups_train_again_once(
        model_dir: Path, tmp_path: Path) -> None:  # noqa: F811 - the imported fixture
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=2)
    spec = consumer_spec(run_cfg, cfg, bus.subjects)
    await bus.publish_groups(*(trainable(f"t{i}") for i in range(8)))
    first = Trainer(bus, run_cfg, cfg)
    await first.at_step(4)  # checkpoints at steps 2 and 4 (the heartbeat follows the commit)
    await bus.publish_groups(filtered("f0"), filtered("f1"))  # no batch fills: a ledger-only save
    await until("the drops settled", lambda: {"f0", "f1"} <= set(bus.acked()))
    await first.crash()
    acked_before = set(bus.acked())
    assert acked_before  # the property below is about something

    damage_the_newest(tmp_path)  # step 4's weights, found damaged at the restart
    restored = checkpoint.peek_latest(tmp_path / "checkpoints")  # what the restart falls back to
    assert restored is not None and restored.step == 2
    # Every group acked before the crash is in the fallback's ledger: the stream will not bring it
    # back, and the fallback does not need it.
    assert acked_before <= set(restored.consumed), sorted(acked_before - set(restored.consumed))

    bus.redeliver_held(spec)  # ack_wait passes: what the first trainer held comes back
    before = len(bus.fetched)
    second = Trainer(bus, run_cfg, cfg.model_copy(update={"max_steps": 4}))
    hb = await second.until("done", lambda hb: hb is not None and hb.state == "done", timeout=15)
    await second.stop()

    assert len(list((tmp_path / "checkpoints").glob("*.corrupt"))) == 1
    # Steps 3 and 4 are trained again from their groups, redelivered because never acked.
    assert sorted(g for g, _ in bus.fetched[before:]) == ["t4", "t5", "t6", "t7"]
    assert hb.metrics[TrainerKeys.groups("train")] == 4 and hb.metrics.get(TrainerKeys.groups("duplicate"), 0) == 0
    assert hb.metrics[TrainerKeys.GROUPS_TRAINED_TOTAL] == 8  # 4 restored with step 2's counters + 4
    state = checkpoint_state(tmp_path)
    assert state is not None and state["step"] == 4
    assert state["consumed"] == {**trained(range(8)), "f0": "filtered", "f1": "filtered"}
    assert_every_ack_covered(bus)
    assert Counter(bus.acked()) == Counter([f"t{i}" for i in range(8)] + ["f0", "f1"])  # each exactly once


async def test_while_running_nothing_is_acked_that_the_checkpoint_before_the_newest_lacks(
        model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=1)
    spec = consumer_spec(run_cfg, cfg, bus.subjects)
    await bus.publish_groups(*(trainable(f"t{i}") for i in range(4)), filtered("f0"),
                             *(trainable(f"t{i}") for i in range(4, 8)))
    trainer = Trainer(bus, run_cfg, cfg)
    await trainer.at_step(4)
    bus.redeliver_held(spec)  # copies of the held step-4 groups: duplicates, acked with their originals
    await until("the copies pulled", lambda: {("t6", 2), ("t7", 2)} <= set(bus.fetched), timeout=10)
    await bus.publish_groups(filtered("f1"), filtered("f2"))  # a ledger-only save, given to both checkpoints
    await until("the drops settled", lambda: {"f1", "f2"} <= set(bus.acked()))
    await bus.publish_groups(trainable("t8"), trainable("t9"))
    await trainer.at_step(5)
    running = list(bus.settled)
    hb = await trainer.heartbeat()
    await trainer.stop()

    assert_every_ack_covered(bus)  # each ack while running: the fallback of the newest had it
    # Step 5's checkpoint lets step 4's groups (and their copies) go: steps 1-4 are all acked.
    assert Counter(s.gid for s in running if s.how == "ack") == Counter(
        [f"t{i}" for i in range(8)] + ["t6", "t7", "f0", "f1", "f2"])
    assert all(s.running for s in running)
    # Held: step 5's groups (its checkpoint is the newest, no fallback has them yet).
    assert hb is not None and hb.metrics["trainer/unacked_groups"] == 2
    assert hb.metrics["trainer/held_checkpointed_groups"] == 2  # in the newest ledger and still ack-pending
    assert sorted(s.gid for s in bus.settled if not s.running) == ["t8", "t9"]  # at the clean end


async def test_a_clean_end_whose_final_checkpoint_reads_back_damaged_acks_none_of_it(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=2)
    await bus.publish_groups(*(trainable(f"t{i}") for i in range(6)))
    real_save = checkpoint.save

    def save_onto_a_bad_disk(root: Path, *args: Any, **kwargs: Any) -> Path:
        """The step-3 checkpoint reaches the disk damaged: its save returns, but the bytes differ."""
        folder = real_save(root, *args, **kwargs)
        if args[2].step == 3:
            flip_the_last_byte(folder / checkpoint.MODEL)
        return folder

    monkeypatch.setattr(checkpoint, "save", save_onto_a_bad_disk)
    first = Trainer(bus, run_cfg, cfg.model_copy(update={"max_steps": 3}))
    await first.until("done", lambda hb: hb is not None and hb.state == "done", timeout=15)
    await first.stop()
    monkeypatch.setattr(checkpoint, "save", real_save)
    # Steps 1-2 (t0..t3) are in the step-2 checkpoint, verified intact: acked.  Step 3 (t4, t5) is
    # only in the damaged one: held, and redelivered after ack_wait (the process is gone).
    assert sorted(bus.acked()) == [f"t{i}" for i in range(4)]
    assert_every_ack_covered(bus)

    bus.redeliver_held(consumer_spec(run_cfg, cfg, bus.subjects))
    second = Trainer(bus, run_cfg, cfg.model_copy(update={"max_steps": 3}))
    hb = await second.until("done", lambda hb: hb is not None and hb.state == "done", timeout=15)
    await second.stop()
    assert hb.metrics[TrainerKeys.groups("train")] == 2 and hb.metrics[TrainerKeys.GROUPS_TRAINED_TOTAL] == 6
    state = checkpoint_state(tmp_path)
    assert state is not None and state["step"] == 3 and state["consumed"] == trained(range(6))
    assert Counter(bus.acked()) == Counter(f"t{i}" for i in range(6))
