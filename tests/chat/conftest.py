"""Fixtures of the chat-endpoint tests: the chat tokenizer, the chat policy (random or briefly
warm-started), and a scripted backend whose turns are chosen by the test."""

from __future__ import annotations

import fcntl
import hashlib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import CACHE, ROOT

# Enough for the policy to emit the template's tool-call format (measured: 150 steps, about a
# minute on one thread; samples at temperature 1 are well-formed calls for most seeds).
WARM_STEPS = 150


def _key() -> str:
    h = hashlib.sha256((ROOT / "services/policy/chat_model.py").read_bytes())
    h.update((ROOT / "services/policy/model_init.py").read_bytes())
    for dist in ("torch", "transformers", "tokenizers"):
        h.update(metadata.version(dist).encode())
    return h.hexdigest()[:12]


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    from rlbus.services.policy.chat_model import build_chat_tokenizer

    return build_chat_tokenizer(seed=0)


@pytest.fixture(scope="session")
def chat_model_warm() -> Path:
    """The chat policy with a short warm start, cached under tests/.cache keyed by its build code."""
    out = CACHE / f"chat-calculator-w{WARM_STEPS}-{_key()}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            from rlbus.services.policy.chat_model import build_chat_model

            build_chat_model(out, seed=0, warm_steps=WARM_STEPS, overwrite=True, log=lambda _: None)
    return out


@dataclass
class Sample:
    completion_ids: list[int]
    behaviour_logprobs: np.ndarray
    token_versions: np.ndarray
    finish_reason: str


@dataclass
class ScriptedBackend:
    """Answers each sample call with the next scripted text, encoded as the policy would sample it
    (the end-of-turn token appended unless the text is cut), logprob -0.5 per token, at `version`."""

    tokenizer: Any
    script: list[tuple[str, bool]] = field(default_factory=list)  # (text, ended)
    version: int = 0
    max_context: int | None = 1024
    prompts: list[list[int]] = field(default_factory=list)

    def sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int], seed: int) -> Any:
        self.prompts.append(list(prompts[0]))
        text, ended = self.script.pop(0)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if ended:
            ids.append(self.tokenizer.eos_token_id)
        return [[Sample(ids, np.full(len(ids), -0.5, np.float32), np.full(len(ids), self.version, np.int64),
                        "stop" if ended else "length")]]


class RecordingBus:
    """Keeps what is published (the endpoint only publishes)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, str]] = []

    async def publish(self, subject: str, data: bytes, *, msg_id: str, headers: Any = None) -> None:
        self.published.append((subject, data, msg_id))
