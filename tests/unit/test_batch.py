"""Batch assembly: which scored groups train, which are dropped, and why — nothing vanishes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.schemas import Rollout, ScoredGroup, ScoredRollout, Task, spans_from_versions
from rlbus.services.trainer.batch import Assembler, ready_to_ack

PROMPT = [1, 5, 6, 7, 14, 8, 9, 10, 17]


def rollout(task_id: str, index: int, versions: list[int]) -> Rollout:
    n = len(versions)
    return Rollout(
        rollout_id=f"{task_id}/{index}", task_id=task_id, index=index,
        token_ids=np.array(PROMPT + [9] * n, dtype="<i4"), prompt_len=len(PROMPT),
        loss_mask=np.ones(n, dtype="|u1"), behaviour_logprobs=np.full(n, -0.5, dtype="<f4"),
        version_spans=spans_from_versions(np.array(versions)), text="579",
    )


def group(gid: str, rewards: list[float], versions: list[int | list[int]] | int = 0,
          errors: dict[int, str] | None = None, env_failures: frozenset[int] = frozenset(), pool: str = "train",
          generator: str = "") -> ScoredGroup:
    """One scored group; ``versions`` per rollout is one version or a per-token list."""
    errors = errors or {}
    if isinstance(versions, int):
        versions = [versions] * len(rewards)
    scored = []
    for i, (reward, v) in enumerate(zip(rewards, versions, strict=True)):
        per_token = v if isinstance(v, list) else [v, v, v]
        scored.append(ScoredRollout(rollout=rollout(gid, i, per_token), reward=reward,
                                    verifier_error=errors.get(i, ""), env_failure=i in env_failures))
    task = Task(run="demo", task_id=gid, pool=pool, env="addition", prompt="123+456=", answer="579",
                group_size=len(rewards))
    return ScoredGroup(task=task, scored=scored, generator_id=generator)


def test_a_fresh_group_with_a_learning_signal_trains():
    a = Assembler(batch_groups=2, max_staleness=1)
    d = a.offer(group("g1", [1.0, 0.0, 0.0], versions=3), "h1", version=3, consumed=set())
    assert d.reason == "train" and d.handle == "h1"
    assert d.train_mask == [True, True, True]
    assert a.kept == [d] and not a.dropped and not a.full


def test_a_stale_rollout_is_not_trained_but_its_group_and_reward_count():
    a = Assembler(batch_groups=4, max_staleness=1)
    # version 5: a rollout sampled (partly) at version 3 is 2 versions old, beyond max_staleness=1.
    g = group("g1", [1.0, 0.0, 0.0], versions=[5, [3, 4, 5], 4])
    d = a.offer(g, None, version=5, consumed=set())
    assert d.reason == "train"
    assert d.staleness == [0, 2, 1]  # judged by the oldest token, not the newest
    assert d.train_mask == [True, False, True]
    assert d.baseline_mask == [True, True, True]  # its reward still counts in the group baseline
    assert a.rollouts_stale == 1
    assert a.counts["train"] == 1


def test_a_group_with_every_rollout_stale_is_dropped_as_stale():
    a = Assembler(batch_groups=4, max_staleness=0)
    d = a.offer(group("g1", [1.0, 0.0], versions=2), None, version=3, consumed=set())
    assert d.reason == "stale" and a.dropped == [d] and not a.kept
    assert a.counts == {"stale": 1}


def test_equal_rewards_are_filtered():
    a = Assembler(batch_groups=4, max_staleness=1)
    d = a.offer(group("g1", [1.0, 1.0, 1.0, 1.0]), None, version=0, consumed=set())
    assert d.reason == "filtered" and a.dropped == [d] and not a.kept


def test_an_invalid_rollout_does_not_break_a_tie():
    """Rewards 1, 1 and an errored 0: the 0 is not evidence, so there is no learning signal."""
    a = Assembler(batch_groups=4, max_staleness=1)
    d = a.offer(group("g1", [1.0, 1.0, 0.0], errors={2: "math: TimeoutError()"}), None, version=0, consumed=set())
    assert d.reason == "filtered"


def test_a_verifier_error_excludes_that_rollout_from_training_and_baseline():
    a = Assembler(batch_groups=4, max_staleness=1)
    g = group("g1", [1.0, 0.0, 0.0, 1.0], errors={1: "math: ValueError('bad')"}, env_failures=frozenset({3}))
    d = a.offer(g, None, version=0, consumed=set())
    assert d.reason == "train"
    assert d.train_mask == [True, False, True, False]
    assert d.baseline_mask == [True, False, True, False]
    assert a.rollouts_invalid == 2


def test_a_group_without_any_valid_rollout_is_invalid():
    a = Assembler(batch_groups=4, max_staleness=1)
    d = a.offer(group("g1", [0.0, 1.0], errors={0: "x", 1: "y"}), None, version=0, consumed=set())
    assert d.reason == "invalid"


def test_a_redelivered_group_is_a_duplicate():
    a = Assembler(batch_groups=4, max_staleness=1)
    # Already trained on before a crash:
    assert a.offer(group("g0", [1.0, 0.0]), None, version=0, consumed={"g0"}).reason == "duplicate"
    # Redelivered while the first copy waits in the current batch:
    first = a.offer(group("g1", [1.0, 0.0]), "first", version=0, consumed=set())
    second = a.offer(group("g1", [1.0, 0.0]), "second", version=0, consumed=set())
    assert (first.reason, second.reason) == ("train", "duplicate")
    assert [d.handle for d in a.kept] == ["first"]
    assert a.counts == {"duplicate": 2, "train": 1}


def test_a_duplicate_is_acked_only_once_its_original_is_committed():
    """Acking a redelivered copy acks its original (one message): never before the original is
    in a checkpoint, or a crash in between loses the group."""
    a = Assembler(batch_groups=4, max_staleness=1)
    original = a.offer(group("g1", [1.0, 0.0]), "first", version=0, consumed=set())
    copy = a.offer(group("g1", [1.0, 0.0]), "second", version=0, consumed=set())
    filtered = a.offer(group("g2", [1.0, 1.0]), "third", version=0, consumed=set())
    now, later = ready_to_ack([copy, filtered], committed={"g2"})
    assert (now, later) == ([filtered], [copy])  # g1 still waits in the batch
    now, later = ready_to_ack([original, copy], committed={"g1", "g2"})
    assert (now, later) == ([original, copy], [])

def test_take_returns_one_batch_and_every_drop_since_the_last_take():
    a = Assembler(batch_groups=2, max_staleness=1)
    for i in range(3):
        a.offer(group(f"t{i}", [1.0, 0.0]), f"t{i}", version=0, consumed=set())
    a.offer(group("f", [0.0, 0.0]), "f", version=0, consumed=set())
    assert a.full
    batch, dropped = a.take()
    assert [d.handle for d in batch] == ["t0", "t1"]
    assert [(d.handle, d.reason) for d in dropped] == [("f", "filtered")]
    assert [d.handle for d in a.kept] == ["t2"] and not a.full
    batch, dropped = a.take()  # drops are handed over once
    assert [d.handle for d in batch] == ["t2"] and dropped == []


def test_requeue_after_a_version_bump_drops_groups_that_became_stale():
    a = Assembler(batch_groups=8, max_staleness=1)
    old = a.offer(group("old", [1.0, 0.0], versions=3), "old", version=4, consumed=set())
    mixed = a.offer(group("mixed", [1.0, 0.0], versions=[3, 4]), "mixed", version=4, consumed=set())
    new = a.offer(group("new", [1.0, 0.0], versions=4), "new", version=4, consumed=set())
    assert [d.reason for d in (old, mixed, new)] == ["train"] * 3
    out = a.requeue_stale(5)
    assert out == [old] and old.reason == "stale" and old.staleness == [2, 2]
    assert [d.handle for d in a.kept] == ["mixed", "new"]
    assert mixed.train_mask == [False, True]  # its version-3 rollout is no longer trained on
    assert a.counts == {"train": 2, "stale": 1}
    _, dropped = a.take()
    assert dropped == [old]


def test_outcomes_are_tallied_per_pool_and_per_generator():
    """What the controller's balance accounting reads: a duplicate is no outcome of its own, and a
    group that goes stale while held moves from train to stale and counts as stale_held too."""
    a = Assembler(batch_groups=8, max_staleness=0)
    a.offer(group("t0", [1.0, 0.0], pool="math", generator="gen-0"), None, version=0, consumed=set())
    a.offer(group("t0", [1.0, 0.0], pool="math", generator="gen-0"), None, version=0, consumed=set())  # a copy
    a.offer(group("t1", [1.0, 0.0], pool="code", generator="gen-1"), None, version=0, consumed=set())
    a.offer(group("f0", [1.0, 1.0], pool="math", generator="gen-1"), None, version=0, consumed=set())
    a.offer(group("i0", [1.0, 0.0], errors={0: "x", 1: "y"}, pool="code"), None, version=0, consumed=set())
    a.requeue_stale(1)  # both kept groups are one version old now
    a.offer(group("s0", [1.0, 0.0], pool="code", generator="gen-1"), None, version=1, consumed=set())
    o = a.outcomes
    assert o.by_pool == {"math": {"train": 0, "stale": 1, "stale_held": 1, "filtered": 1},
                         "code": {"train": 0, "stale": 2, "stale_held": 1, "invalid": 1}}
    # i0 came from no known generator: counted per pool only.
    assert o.by_generator == {"gen-0": {"train": 0, "stale": 1, "stale_held": 1},
                              "gen-1": {"train": 0, "stale": 2, "stale_held": 1, "filtered": 1}}
    assert o.total("stale_held") == 2 and o.total("stale") == a.counts["stale"] == 3
    assert sum(o.total(r) for r in ("train", "filtered", "invalid", "stale")) == sum(a.counts.values()) - 1



def test_generator_ids_off_the_wire_cannot_blow_up_the_trainers_heartbeat(monkeypatch):
    """Each reported generator id becomes metric names: one that is no subject token, or one past
    the cap of distinct ids, is counted per pool only (a 3,000-character id from the fuzz test
    made the trainer's heartbeat unbuildable and killed it)."""
    import rlbus.services.trainer.batch as batch

    monkeypatch.setattr(batch, "MAX_GENERATORS", 2)
    a = Assembler(batch_groups=8, max_staleness=0)
    for i, gen in enumerate(["gen-0", "x" * 3000, "a.b", "gen-1", "gen-2", "gen-0"]):
        a.offer(group(f"t{i}", [1.0, 0.0], pool="math", generator=gen), None, version=0, consumed=set())
    assert set(a.outcomes.by_generator) == {"gen-0", "gen-1"}
    assert a.outcomes.by_generator["gen-0"]["train"] == 2 and a.outcomes.total("train") == 6

@settings(max_examples=150, deadline=None)
@given(
    batch_groups=st.integers(1, 4),
    max_staleness=st.integers(0, 2),
    offers=st.lists(
        st.tuples(
            st.sampled_from([f"g{i}" for i in range(6)]),  # repeats are redeliveries
            st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 4), st.booleans()),
                     min_size=1, max_size=4),
            st.integers(0, 4),  # trainer version when offered
        ),
        max_size=20,
    ),
)
def test_every_offered_group_is_trained_or_dropped_with_a_reason(batch_groups, max_staleness, offers):
    a = Assembler(batch_groups=batch_groups, max_staleness=max_staleness)
    consumed: set[str] = set()
    trained, dropped = [], []
    last_version = 0
    for n, (gid, members, version) in enumerate(offers):
        if version > last_version:  # the trainer moved on: kept groups are re-judged
            for d in a.requeue_stale(version):
                assert d.reason == "stale" and not any(d.train_mask)
            last_version = version
        rewards = [r for r, _, _ in members]
        g = group(gid, rewards, versions=[v for _, v, _ in members],
                  errors={i: "boom" for i, (_, _, bad) in enumerate(members) if bad})
        d = a.offer(g, n, version=version, consumed=consumed)
        for i, s in enumerate(g.scored):
            fresh = version - s.rollout.oldest_version <= max_staleness
            assert d.train_mask[i] == (s.valid and fresh)
            assert d.baseline_mask[i] == s.valid
        if a.full:
            batch, drops = a.take()
            assert len(batch) == batch_groups
            trained += batch
            dropped += drops
            consumed |= {d.group.task.task_id for d in batch}
    batch, drops = a.take()
    trained += batch
    dropped += drops
    handles = sorted(d.handle for d in trained + dropped)
    assert handles == list(range(len(offers)))  # nothing vanishes, nothing is counted twice
    assert {d.reason for d in trained} <= {"train"}
    assert {d.reason for d in dropped} <= {"filtered", "stale", "invalid", "duplicate"}
    assert sum(a.counts.values()) == len(offers)
    assert a.counts["train"] == len(trained)
    for outcome in ("train", "filtered", "invalid", "stale"):  # the per-pool tally adds up to the counts
        assert a.outcomes.total(outcome) == a.counts[outcome]
    ids = [d.group.task.task_id for d in trained]
    assert len(ids) == len(set(ids))  # a group is never trained on twice
    for d in trained:
        assert any(d.train_mask)
        assert len({s.reward for s, b in zip(d.group.scored, d.baseline_mask, strict=True) if b}) >= 2


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_staleness_boundary_is_inclusive(max_staleness):
    a = Assembler(batch_groups=4, max_staleness=max_staleness)
    at_limit = a.offer(group("a", [1.0, 0.0], versions=10 - max_staleness), None, version=10, consumed=set())
    beyond = a.offer(group("b", [1.0, 0.0], versions=9 - max_staleness), None, version=10, consumed=set())
    assert (at_limit.reason, beyond.reason) == ("train", "stale")


# --- checkpoint ledger ---------------------------------------------------------------------


def test_a_ledger_only_save_adds_dropped_groups_and_never_runs_ahead_of_the_model(tmp_path):
    import torch

    from rlbus.services.trainer import checkpoint

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    root = tmp_path / "ckpt"
    state = checkpoint.TrainerState(step=2, version=2, consumed={"a": "train"}, counters={"groups_trained_total": 1})
    checkpoint.save(root, model, optimizer, state, keep=2)
    # A step ran since (not checkpointed yet), then groups were dropped while the next batch filled.
    state.step, state.version = 3, 3
    state.consumed.update({"b": "train", "c": "filtered"})
    checkpoint.save_ledger(root, model, optimizer, state, keep=2, dropped={"c": "filtered"})
    on_disk = checkpoint.peek_latest(root)  # the ledger lives beside the checkpoint, not in its state.json
    assert on_disk is not None and on_disk.step == 2 and on_disk.consumed == {"a": "train", "c": "filtered"}
    restored = checkpoint.load_latest(root, torch.nn.Linear(2, 2), torch.optim.AdamW(model.parameters()))
    assert restored is not None and restored.consumed == {"a": "train", "c": "filtered"}


def test_a_ledger_only_save_with_no_checkpoint_writes_a_full_one(tmp_path):
    import torch

    from rlbus.services.trainer import checkpoint

    model = torch.nn.Linear(2, 2)
    state = checkpoint.TrainerState(step=1, version=1, consumed={"a": "train", "c": "stale"})
    checkpoint.save_ledger(tmp_path, model, torch.optim.AdamW(model.parameters()), state, keep=2, dropped={"c": "stale"})
    assert (tmp_path / "step-00000001" / "model.safetensors").exists()
