"""The addition task: disjoint deterministic splits, strict verifier, task-file shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.services.tasks.addition import (
    AdditionTask,
    TaskError,
    make_split,
    parse_answer,
    score,
    split_of,
    write_jsonl,
)


def test_prompt_and_answer() -> None:
    task = AdditionTask(task_id="t", a=123, b=456)
    assert task.prompt == "123+456="
    assert task.answer == "579"
    assert AdditionTask(task_id="u", a=999, b=999).answer == "1998"


def test_split_is_deterministic_and_seed_dependent() -> None:
    assert make_split("train", 300, seed=7) == make_split("train", 300, seed=7)
    assert make_split("train", 300, seed=7) != make_split("train", 300, seed=8)
    # A longer draw with the same seed extends the shorter one (same stream).
    assert make_split("heldout", 500, seed=3)[:200] == make_split("heldout", 200, seed=3)


def test_train_and_heldout_never_share_a_problem() -> None:
    train = make_split("train", 20_000, seed=0)
    heldout = make_split("heldout", 2_000, seed=0)
    # Unordered pairs: the commutative twin of a held-out problem is not trained on either.
    train_pairs = {frozenset((t.a, t.b)) for t in train}
    heldout_pairs = {frozenset((t.a, t.b)) for t in heldout}
    assert not train_pairs & heldout_pairs
    assert all(split_of(t.a, t.b) == "heldout" and split_of(t.b, t.a) == "heldout" for t in heldout)
    # Whatever the seed, a training draw never hits a held-out pair.
    assert all(split_of(t.a, t.b) == "train" for t in make_split("train", 5_000, seed=123))


def test_split_tasks_are_distinct_three_digit_problems() -> None:
    tasks = make_split("train", 5_000, seed=1)
    assert len({t.task_id for t in tasks}) == len(tasks)
    assert all(100 <= t.a <= 999 and 100 <= t.b <= 999 for t in tasks)
    assert all(t.task_id == f"add-{t.a}-{t.b}" for t in tasks)


def test_heldout_is_about_a_tenth_of_all_pairs() -> None:
    heldout = sum(split_of(a, b) == "heldout" for a in range(100, 1000, 7) for b in range(100, 1000, 3))
    total = len(range(100, 1000, 7)) * len(range(100, 1000, 3))
    assert 0.07 < heldout / total < 0.13


def test_make_split_rejects_bad_requests() -> None:
    with pytest.raises(TaskError, match="unknown split"):
        make_split("test", 10, seed=0)  # type: ignore[arg-type]
    with pytest.raises(TaskError, match="out of range"):
        make_split("heldout", 10_000_000, seed=0)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("579", 1.0),
        (" 579 \n", 1.0),
        ("579<eos>", 1.0),
        ("579<eos>garbage after the end", 1.0),
        ("578", 0.0),
        ("5790", 0.0),
        ("0579", 0.0),
        ("57", 0.0),
        ("579.", 0.0),
        ("5 79", 0.0),
        ("579abc", 0.0),
        ("the answer is 579", 0.0),
        ("", 0.0),
        ("<eos>579", 0.0),
    ],
)
def test_score_is_exact(completion: str, expected: float) -> None:
    assert score("579", completion) == expected


def test_parse_answer_is_strict() -> None:
    assert parse_answer("1998<eos>") == "1998"
    assert parse_answer("-12") == "-12"
    assert parse_answer("12-") is None
    assert parse_answer("１２") is None  # full-width digits are not ASCII digits
    assert parse_answer("  ") is None


def test_write_jsonl_has_the_task_file_shape(tmp_path: Path) -> None:
    tasks = [AdditionTask(task_id="add-123-456", a=123, b=456), *make_split("heldout", 4, seed=0)]
    path = tmp_path / "sub" / "tasks.jsonl"
    assert write_jsonl(path, tasks) == 5
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {
        "task_id": "add-123-456",
        "prompt": "123+456=",
        "env": "addition",
        "env_config": {"a": 123, "b": 456},
        "answer": "579",
    }
    for line, task in zip(lines, tasks, strict=True):
        record = json.loads(line)
        assert record["answer"] == str(record["env_config"]["a"] + record["env_config"]["b"])
        assert record["prompt"] == task.prompt
