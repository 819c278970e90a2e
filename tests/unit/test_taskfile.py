"""Task files: every bad line is reported with its line number and reason, before anything is
published — a task that passes here must also decode on every generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rlbus.schemas import SamplingParams, Task
from rlbus.services.runtime.taskfile import read_task_file
from rlbus.services.tasks.addition import make_split, write_jsonl

GOOD = {"task_id": "add-1", "prompt": "123+456=", "env": "addition", "answer": "579",
        "env_config": {"a": 123, "b": 456}}
OTHER = {**GOOD, "task_id": "add-2"}


def write(tmp_path: Path, lines: list[object]) -> Path:
    p = tmp_path / "tasks.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def read(path: Path, **kw):
    return read_task_file(path, run="demo", pool="train", **kw)


def test_a_good_file_becomes_tasks(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, make_split("train", 5, seed=0))
    tasks, errors = read(path, group_size=4)
    assert errors == []
    assert len(tasks) == 5
    for t in tasks:
        assert (t.run, t.pool, t.env, t.group_size) == ("demo", "train", "addition", 4)
        assert t.answer == str(t.env_config["a"] + t.env_config["b"])
        assert Task.decode(t.encode()).task_id == t.task_id


def test_every_bad_line_is_reported_with_its_number_and_reason(tmp_path):
    path = write(tmp_path, [
        GOOD,                                                # 1
        '{"task_id": "add-2", "prompt": "1+1=", "env": ',    # 2: truncated JSON
        {**GOOD, "task_id": "add-3", "promt": "typo"},       # 3: unknown key
        {**GOOD, "task_id": "add-4", "prompt": ""},          # 4: empty prompt
        "",                                                  # 5: blank lines are fine
        {**GOOD},                                            # 6: duplicate of line 1
        {**GOOD, "task_id": "add-7"},                        # 7: fine
    ])
    tasks, errors = read(path)
    assert [t.task_id for t in tasks] == ["add-1", "add-7"]
    by_line = {e.line: e.reason for e in errors}
    assert sorted(by_line) == [2, 3, 4, 6]
    assert "not valid JSON" in by_line[2] and "column" in by_line[2]
    assert "promt" in by_line[3] and "prompt" in by_line[3].split("allowed")[1]
    assert "empty prompt" in by_line[4]
    assert "duplicate task_id 'add-1'" in by_line[6]
    assert str(errors[0]).startswith("line 2: ")


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ([1, 2, 3], "JSON object"),
        ({"prompt": "1+1=", "env": "addition"}, "task_id"),
        ({**OTHER, "env": ""}, "env"),
        ({**OTHER, "group_size": 0}, "group_size"),
        ({**OTHER, "group_size": "many"}, "many"),
        ({**OTHER, "sampling": {"temperature": -1}}, "temperature"),
        ({**OTHER, "sampling": {"temprature": 1}}, "temprature"),
        ({**OTHER, "sampling": "greedy"}, "sampling"),
        ({**OTHER, "prompt_ids": ["a", "b"]}, "prompt_ids"),
        ({**OTHER, "prompt_ids": [2**40]}, "prompt_ids"),
        ({**OTHER, "prompt_ids": [[1, 2], [3, 4]]}, "prompt_ids"),
        ({**OTHER, "env_config": "a=1"}, "env_config"),
        ({**OTHER, "verifier": 7}, "verifier"),
        ({**OTHER, "metadata": {"big": 2**70}}, "does not fit"),
    ],
)
def test_a_line_that_would_not_survive_the_wire_is_an_error(tmp_path, line, words):
    """Each of these used to be published and then dead-lettered by every generator (or crash
    the reader); they must fail here, on their own line, with the others still read."""
    path = write(tmp_path, [GOOD, line])
    tasks, errors = read(path)
    assert [t.task_id for t in tasks] == ["add-1"]
    assert [e.line for e in errors] == [2]
    assert words in errors[0].reason


def test_defaults_from_the_caller_apply_unless_the_line_overrides_them(tmp_path):
    path = write(tmp_path, [GOOD, {**GOOD, "task_id": "add-2", "group_size": 2,
                                   "sampling": {"temperature": 0.0, "max_new_tokens": 4}}])
    default_sampling = SamplingParams(temperature=0.7, max_new_tokens=6)
    tasks, errors = read(path, group_size=16, sampling=default_sampling, eval=True)
    assert errors == []
    assert (tasks[0].group_size, tasks[0].sampling, tasks[0].eval) == (16, default_sampling, True)
    assert (tasks[1].group_size, tasks[1].sampling.temperature, tasks[1].sampling.max_new_tokens) == (2, 0.0, 4)


def test_prompt_ids_instead_of_text(tmp_path):
    path = write(tmp_path, [{"task_id": "ids-1", "prompt_ids": [1, 5, 6], "env": "single_turn"}])
    tasks, errors = read(path)
    assert errors == []
    assert tasks[0].prompt_ids.dtype.str == "<i4" and tasks[0].prompt_ids.tolist() == [1, 5, 6]
    assert np.array_equal(Task.decode(tasks[0].encode()).prompt_ids, [1, 5, 6])


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read(tmp_path / "nope.jsonl")
