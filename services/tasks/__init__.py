"""Synthetic verifiable tasks shared by the feeder, the environment, the reward and evaluation."""

from rlbus.services.tasks.addition import (
    AdditionTask,
    TaskError,
    make_split,
    parse_answer,
    score,
    split_of,
    task_record,
    write_jsonl,
)

__all__ = [
    "AdditionTask",
    "TaskError",
    "make_split",
    "parse_answer",
    "score",
    "split_of",
    "task_record",
    "write_jsonl",
]
