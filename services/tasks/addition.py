"""3-digit addition: the toy verifiable task that the local pipeline learns end to end.

Why it exists: RL needs a reward that a program can check exactly and that a 1M-parameter
model can learn in minutes on a CPU. "123+456=" → "579" is that: the verifier is string
equality, the warm-started policy gets about a third right, and GRPO pushes it past 0.9.

The train/held-out split is decided by a hash of the operand pair, not by sampling, so the
two splits are disjoint by construction for every seed and size: a held-out sum is never
trained on, whatever `n` and `seed` the feeder and the evaluator choose. The pair is
unordered (a+b and b+a land in the same split) so the commutative twin of a held-out prompt
is not a training example either.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ENV_NAME = "addition"
OPERAND_MIN = 100
OPERAND_MAX = 999
# One pair in HELDOUT_MODULUS is held out (about 10% of the 810,000 ordered pairs).
HELDOUT_MODULUS = 10
EOS_MARKER = "<eos>"

Split = Literal["train", "heldout"]


class TaskError(ValueError):
    """Root error of `rlbus.services.tasks`: a request the task generator cannot satisfy."""


@dataclass(frozen=True)
class AdditionTask:
    """One addition problem; `answer` is what the verifier compares the completion to."""

    task_id: str
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def split_of(a: int, b: int) -> Split:
    """Which split the unordered pair {a, b} belongs to (stable across runs and machines)."""
    lo, hi = min(a, b), max(a, b)
    digest = hashlib.blake2b(f"{lo}+{hi}".encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "big") % HELDOUT_MODULUS == 0 else "train"


def task_id_for(a: int, b: int) -> str:
    """Stable id: the same problem has the same id in every split file and every run."""
    return f"add-{a}-{b}"


def make_split(split: Split, n: int, seed: int) -> list[AdditionTask]:
    """`n` distinct tasks of `split`, the same list for the same (split, n, seed)."""
    if split not in ("train", "heldout"):
        raise TaskError(f"unknown split {split!r}: use 'train' or 'heldout'")
    span = OPERAND_MAX - OPERAND_MIN + 1
    share = span * span // HELDOUT_MODULUS
    # Half of the split's pairs at most: rejection sampling needs room to finish quickly.
    capacity = (share if split == "heldout" else span * span - share) // 2
    if n < 0 or n > capacity:
        raise TaskError(f"n={n} is out of range for split {split!r}: use 0 <= n <= {capacity}")
    # The split name is part of the seed so train and held-out draws are independent streams.
    rng = random.Random(f"{ENV_NAME}:{split}:{seed}")
    seen: set[tuple[int, int]] = set()
    tasks: list[AdditionTask] = []
    while len(tasks) < n:
        a = rng.randint(OPERAND_MIN, OPERAND_MAX)
        b = rng.randint(OPERAND_MIN, OPERAND_MAX)
        if (a, b) in seen or split_of(a, b) != split:
            continue
        seen.add((a, b))
        tasks.append(AdditionTask(task_id=task_id_for(a, b), a=a, b=b))
    return tasks


def parse_answer(completion_text: str) -> str | None:
    """The integer the completion states, or None when it is not exactly one integer.

    Strict on purpose (no partial credit, no "first number in the text"): text after the
    end-of-sequence marker is ignored, surrounding whitespace is ignored, anything else
    ("579.", "5 79", "579abc", "") makes the answer unparseable.
    """
    text = completion_text.split(EOS_MARKER, 1)[0].strip()
    digits = text[1:] if text.startswith("-") else text
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    return text


def score(task_answer: str, completion_text: str) -> float:
    """1.0 when the completion states exactly `task_answer`, else 0.0."""
    return 1.0 if parse_answer(completion_text) == task_answer.strip() else 0.0


def task_record(task: AdditionTask, sampling: dict[str, object] | None = None) -> dict[str, object]:
    """The rlbus task-file shape of one task (one JSON line of a task file)."""
    record: dict[str, object] = {
        "task_id": task.task_id,
        "prompt": task.prompt,
        "env": ENV_NAME,
        "env_config": {"a": task.a, "b": task.b},
        "answer": task.answer,
    }
    if sampling:
        record["sampling"] = dict(sampling)
    return record


def write_jsonl(path: str | Path, tasks: Iterable[AdditionTask], sampling: dict[str, object] | None = None) -> int:
    """Write one task per line (each with ``sampling`` when given); returns how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task_record(task, sampling), separators=(",", ":")) + "\n")
            count += 1
    return count
