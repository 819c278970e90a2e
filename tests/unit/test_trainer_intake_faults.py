"""A well-typed but hostile scored group never kills the trainer: it is refused alone, with a reason.

The schemas guarantee shapes (prompt_len within the tokens, one loss-mask entry and one behaviour
logprob per completion token, a finite reward); they cannot know the model.  A reward of 1e308
overflows the float32 batch, a token id outside the vocabulary or a rollout longer than the
model's context cannot be scored.  Such a group used to be accepted for training and fail inside
the step, killing the trainer, which then crash-looped on its redelivery.  Now:

- the trainer judges each group as it takes it in: a hostile one is recorded in the ledger as
  ``invalid`` and dead-lettered with a reason naming the rollout, the field, the value and the
  limit, only once a checkpoint covers it (like an ack); the good groups around it train;
- should a step still refuse its input, the groups at fault are refused the same way and the
  others go back for the next batch: the trainer keeps training.

The service-level tests use the in-memory bus harness of ``test_trainer_service.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlbus.schemas import ScoredGroup, spans_from_versions
from rlbus.schemas.metric_keys import TrainerKeys
from tests.unit.test_trainer_service import (  # noqa: F401 - model_dir, mark_the_clean_end are fixtures
    LOGP,
    RecordingBus,
    Trainer,
    assert_every_ack_covered,
    checkpoint_state,
    configs,
    mark_the_clean_end,
    model_dir,
    trainable,
    uploads,
)

torch.set_num_threads(1)


def model_limits(model_dir: Path) -> tuple[int, int]:  # noqa: F811 - the imported fixture's name
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return int(config.vocab_size), int(config.max_position_embeddings)


def with_rollout(group: ScoredGroup, index: int, **changes: Any) -> ScoredGroup:
    """``group`` with rollout ``index`` changed (``reward`` on the scored rollout, the rest on the rollout)."""
    scored = list(group.scored)
    s = scored[index]
    reward = changes.pop("reward", s.reward)
    rollout = dataclasses.replace(s.rollout, **changes) if changes else s.rollout
    scored[index] = dataclasses.replace(s, rollout=rollout, reward=reward)
    return dataclasses.replace(group, scored=scored)


def with_token(group: ScoredGroup, index: int, token: int) -> ScoredGroup:
    ids = group.scored[index].rollout.token_ids.copy()
    ids[-1] = token  # a completion token: what the step would score
    return with_rollout(group, index, token_ids=ids)


def too_long(group: ScoredGroup, index: int, total: int) -> ScoredGroup:
    r = group.scored[index].rollout
    n = total - r.prompt_len
    ids = np.concatenate([r.token_ids[: r.prompt_len], np.full(n, 7, dtype="<i4")]).astype("<i4")
    return with_rollout(group, index, token_ids=ids, loss_mask=np.ones(n, dtype="|u1"),
                        behaviour_logprobs=np.full(n, LOGP, dtype="<f4"),
                        version_spans=spans_from_versions(np.zeros(n, dtype=np.int64)))


def hostile_groups(model_dir: Path) -> dict[str, tuple[ScoredGroup, list[str]]]:  # noqa: F811
    """Each hostile group found by the fuzz test, with what its dead letter's reason must name."""
    vocab, context = model_limits(model_dir)
    return {
        "r0": (with_rollout(trainable("r0"), 1, reward=1e308), ["reward", "1e+308", "1e+06"]),
        "r1": (with_rollout(trainable("r1"), 2, reward=-1e308), ["reward", "-1e+308", "1e+06"]),
        "v0": (with_token(trainable("v0"), 0, -1), ["token_ids", "-1", f"[0, {vocab})"]),
        "v1": (with_token(trainable("v1"), 3, vocab), ["token_ids", str(vocab), f"[0, {vocab})"]),
        "v2": (with_token(trainable("v2"), 2, 2**31 - 1), ["token_ids", str(2**31 - 1), f"[0, {vocab})"]),
        "l0": (too_long(trainable("l0"), 1, context + 1), ["tokens", str(context + 1),
                                                            f"max_position_embeddings={context}"]),
    }


def assert_refused_once_covered(bus: RecordingBus, refused: set[str]) -> None:
    """Each refused group terminated exactly once, only once the newest checkpoint records it as invalid."""
    terms = [s for s in bus.settled if s.how == "term"]
    assert sorted(s.gid for s in terms) == sorted(refused)
    for s in terms:
        assert s.on_disk is not None and s.on_disk.get(s.gid) == "invalid", f"{s.gid} terminated too early: {s}"


async def test_hostile_groups_are_dead_lettered_with_their_reason_and_the_good_ones_train(
        model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    hostile = hostile_groups(model_dir)
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=1, max_steps=2)
    # Each hostile group would share a batch with a good one (batch_groups = 2).
    good = [trainable(f"t{i}") for i in range(4)]
    order = [good[0], hostile["r0"][0], hostile["v0"][0], good[1], hostile["r1"][0], hostile["v1"][0],
             good[2], hostile["v2"][0], hostile["l0"][0], good[3]]
    await bus.publish_groups(*order)
    trainer = Trainer(bus, run_cfg, cfg)
    hb = await trainer.until("done", lambda hb: hb is not None and hb.state == "done", timeout=90)
    await trainer.stop()

    assert_every_ack_covered(bus)
    assert_refused_once_covered(bus, set(hostile))
    assert sorted(bus.acked()) == [f"t{i}" for i in range(4)]
    state = checkpoint_state(tmp_path)
    assert state is not None and state["step"] == 2
    assert state["consumed"] == {**{f"t{i}": "train" for i in range(4)}, **{gid: "invalid" for gid in hostile}}
    assert hb.metrics[TrainerKeys.GROUPS_TRAINED_TOTAL] == 4
    assert hb.metrics[TrainerKeys.groups("invalid")] == len(hostile)
    letters = {ScoredGroup.decode(dl.data).task.task_id: dl for dl in bus.dead_letters}
    assert set(letters) == set(hostile)
    for gid, (_, names) in hostile.items():
        letter = letters[gid]
        assert letter.origin_subject == bus.subjects.scored("train")
        for name in names:
            assert name in letter.reason, f"{gid}: {name!r} not in the dead letter's reason {letter.reason!r}"


async def test_a_refused_group_redelivered_after_a_crash_is_dead_lettered_again_never_trained(
        model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """The refusal is durable in the ledger: a copy that comes back after a crash between the
    checkpoint and the term is a duplicate of an invalid group, and is terminated with its reason."""
    from rlbus.services.trainer.intake import consumer_spec

    hostile, names = hostile_groups(model_dir)["v1"]
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=1, max_steps=1)
    bus.lose_acks = True  # the first trainer dies after its checkpoint, before its settles arrive
    await bus.publish_groups(trainable("t0"), hostile, trainable("t1"))
    first = Trainer(bus, run_cfg, cfg)
    await first.until("done", lambda hb: hb is not None and hb.state == "done", timeout=90)
    await first.crash()
    assert [s.gid for s in bus.settled if s.how == "term"] == ["v1"] and not bus.dead_letters
    bus.redeliver_held(consumer_spec(run_cfg, cfg, bus.subjects))
    bus.lose_acks = False
    await bus.publish_groups(trainable("t2"), trainable("t3"))

    second = Trainer(bus, run_cfg, configs(model_dir, tmp_path, checkpoint_every=1, max_steps=2)[1])
    hb = await second.until("step 2 done", lambda hb: hb is not None and hb.state == "done"
                            and hb.metrics.get(TrainerKeys.STEP) == 2, timeout=90)
    await second.stop()
    assert_every_ack_covered(bus)
    assert [s.gid for s in bus.settled if s.how == "term"] == ["v1", "v1"], (
        [(s.how, s.gid, s.delivery, s.on_disk_step) for s in bus.settled], bus.fetched)
    assert hb.metrics[TrainerKeys.groups("duplicate")] == 3  # t0, t1 and v1 came back
    state = checkpoint_state(tmp_path)
    assert state is not None and state["consumed"] == {"t0": "train", "t1": "train", "t2": "train",
                                                       "t3": "train", "v1": "invalid"}
    (letter,) = bus.dead_letters
    assert all(n in letter.reason for n in names), letter.reason


async def test_a_step_that_refuses_its_input_refuses_the_group_at_fault_and_trains_the_rest(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Defence in depth: with the intake judge switched off, the step itself meets the bad token."""
    from rlbus.services.trainer import batch

    monkeypatch.setattr(batch, "judge_group", lambda group, limits: "", raising=False)
    hostile, _ = hostile_groups(model_dir)["v1"]
    bus = RecordingBus(tmp_path)
    run_cfg, cfg = configs(model_dir, tmp_path, checkpoint_every=1, max_steps=2)
    await bus.publish_groups(trainable("t0"), hostile, trainable("t1"), trainable("t2"), trainable("t3"))
    trainer = Trainer(bus, run_cfg, cfg)
    hb = await trainer.until("done", lambda hb: hb is not None and hb.state == "done", timeout=90)
    await trainer.stop()

    assert_every_ack_covered(bus)
    assert_refused_once_covered(bus, {"v1"})
    state = checkpoint_state(tmp_path)
    assert state is not None and state["step"] == 2
    assert state["consumed"] == {"t0": "train", "t1": "train", "t2": "train", "t3": "train", "v1": "invalid"}
    assert [m.version for m in uploads(bus)] == [1, 2]  # the refused step made no version
    assert hb.metrics[TrainerKeys.GROUPS_TRAINED_TOTAL] == 4
    # Judged "train" on arrival, it is counted as invalid once refused, and t0 (given back) once.
    assert hb.metrics[TrainerKeys.groups("invalid")] == 1 and hb.metrics[TrainerKeys.groups("train")] == 4
    (letter,) = bus.dead_letters
    assert "token id" in letter.reason and "vocabulary" in letter.reason, letter.reason


# ---- the judge alone ---------------------------------------------------------------------------


def test_the_judge_names_rollout_field_value_and_limit(model_dir: Path) -> None:  # noqa: F811
    from rlbus.services.trainer.judge import InputLimits, judge_group

    vocab, context = model_limits(model_dir)
    limits = InputLimits(vocab_size=vocab, max_positions=context)
    assert judge_group(trainable("ok"), limits) == ""
    for gid, (group, names) in hostile_groups(model_dir).items():
        reason = judge_group(group, limits)
        assert reason and all(n in reason for n in names), (gid, reason)
        assert f"{gid}/" in reason  # the rollout at fault, by id
    # The limits themselves are fine; just past them is not.
    assert judge_group(with_rollout(trainable("b"), 0, reward=1e6), limits) == ""
    assert judge_group(with_rollout(trainable("b"), 0, reward=-1e6 * (1 + 1e-9)), limits)
    assert judge_group(with_token(trainable("b"), 0, vocab - 1), limits) == ""
    assert judge_group(too_long(trainable("b"), 0, context), limits) == ""
    lp = trainable("n").scored[0].rollout.behaviour_logprobs.copy()
    lp[1] = np.nan
    assert "behaviour_logprobs" in judge_group(with_rollout(trainable("n"), 0, behaviour_logprobs=lp), limits)
    # Without a model's limits only what needs none is judged.
    assert judge_group(with_token(trainable("b"), 0, vocab), InputLimits()) == ""
    assert "token_ids" in judge_group(with_token(trainable("b"), 0, -1), InputLimits())
