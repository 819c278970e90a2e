"""Task files (JSONL): parse and validate every line before anything is published.

A line is a JSON object with at least ``task_id`` and ``prompt`` (or ``prompt_ids``) and ``env``;
optional: ``env_config``, ``answer``, ``verifier``, ``group_size``, ``sampling`` {temperature,
top_p, max_new_tokens, stop}, ``metadata``.  Errors carry the line number and the reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlbus.schemas import SamplingParams, SchemaError, Task

_ALLOWED = {"task_id", "prompt", "prompt_ids", "env", "env_config", "answer", "verifier", "group_size",
            "sampling", "metadata"}


@dataclass(frozen=True)
class LineError:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def parse_task(obj: Any, *, run: str, pool: str, group_size: int | None = None,
               sampling: SamplingParams | None = None, eval: bool = False) -> Task:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _ALLOWED
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; allowed: {sorted(_ALLOWED)}")
    if "task_id" not in obj:
        raise ValueError("missing 'task_id'")
    samp = obj.get("sampling")
    if samp is not None:
        if not isinstance(samp, dict):
            raise ValueError("'sampling' must be an object")
        sampling = SamplingParams(**samp)
    ids = obj.get("prompt_ids")
    try:
        prompt_ids = np.asarray(ids if ids is not None else [], dtype="<i4")
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"'prompt_ids' must be a list of int32 token ids ({exc})") from None
    task = Task(
        run=run, task_id=str(obj["task_id"]), pool=pool, env=obj.get("env", ""),
        prompt=obj.get("prompt", ""),
        prompt_ids=prompt_ids,
        env_config=obj.get("env_config", {}), answer=str(obj.get("answer", "")), verifier=obj.get("verifier", ""),
        group_size=int(obj.get("group_size", group_size or 8)), sampling=sampling or SamplingParams(),
        metadata=obj.get("metadata", {}), eval=eval,
    )
    # The constructor checks values, not types: refuse here what every generator would refuse on
    # decode (e.g. a string env_config, nested prompt_ids), instead of publishing a poison task.
    try:
        Task.decode(task.encode())
    except OverflowError as exc:  # msgpack: an integer beyond 64 bits in env_config/metadata
        raise ValueError(f"a number does not fit the wire format ({exc})") from None
    return task


def read_task_file(path: str | Path, *, check: Callable[[Task], None] | None = None,
                   **kw: Any) -> tuple[list[Task], list[LineError]]:
    """Every line of a task file, parsed and validated; ``check`` (e.g. the environments' own
    ``rlbus.services.environment.envs.check_task``) may refuse a task with a ValueError."""
    tasks: list[Task] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"task file {p} does not exist")
    for n, raw in enumerate(p.read_text().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            task = parse_task(json.loads(raw), **kw)
            if check is not None:
                check(task)
            if task.task_id in seen:
                raise ValueError(f"duplicate task_id {task.task_id!r} (ids dedupe publishes; they must be unique)")
            seen.add(task.task_id)
            tasks.append(task)
        except json.JSONDecodeError as exc:
            errors.append(LineError(n, f"not valid JSON ({exc.msg} at column {exc.colno})"))
        except (SchemaError, ValueError, TypeError) as exc:
            errors.append(LineError(n, str(exc)))
    return tasks, errors
