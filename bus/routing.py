"""Which stream stores a subject — pure name logic shared by the JetStream and memory buses
(kept free of nats imports so ``MemoryBus`` stays usable without a server library)."""

from __future__ import annotations

import re

from rlbus.bus.protocol import BusConfigError, StreamKind

_ORIGIN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# The subject's kind token (``rl.<run>.<kind>.…``) -> the stream that stores it.
_KIND_TOKENS: dict[str, StreamKind] = {
    "tasks": "TASKS", "rollouts": "ROLLOUTS", "scored": "SCORED", "weights": "WEIGHTS",
    "uploads": "UPLOADS", "control": "CONTROL", "metrics": "METRICS", "dead": "DEAD",
}
WORK_QUEUES: frozenset[str] = frozenset({"TASKS", "ROLLOUTS", "UPLOADS"})


def stream_kind_of(subject: str) -> StreamKind:
    """The stream kind that stores ``subject`` (``rl.<run>.<kind>.…``)."""
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != "rl" or parts[2] not in _KIND_TOKENS:
        raise BusConfigError(
            f"subject {subject!r} is not stored by any rlbus stream; build subjects with rlbus.bus.subjects.Subjects"
        )
    return _KIND_TOKENS[parts[2]]


def origin_token(subject: str) -> str:
    """The kind token of a subject, used as the dead-letter origin (``rl.r.tasks.math`` -> ``tasks``)."""
    parts = subject.split(".")
    token = parts[2] if len(parts) > 2 and parts[0] == "rl" else ""
    return token if _ORIGIN.match(token) else "unknown"


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` is one token, a trailing ``>`` is one or more."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)
