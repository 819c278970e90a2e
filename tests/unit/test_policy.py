"""Shared policy code: tokenizer, sampled distribution, logprob recompute, sampler, loading.

The properties pinned here are the ones the trainer's consistency metrics rely on: the
sampler's behaviour logprobs equal the trainer's recompute (to float rounding by default,
bit for bit in deterministic mode), and every token carries the weight version that made it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.services.policy.errors import PolicyLoadError, WeightMismatchError
from rlbus.services.policy.load import load_policy, load_state_from_safetensors, load_tokenizer
from rlbus.services.policy.logprobs import LogprobInputError, completion_logprobs
from rlbus.services.policy.model_init import ModelInitError, greedy_accuracy, init_model
from rlbus.services.policy.sampler import GroupSampler, SampleOut, SamplerInputError, StaticSlot
from rlbus.services.policy.sampling import SamplingParams, SamplingParamsError, processed_logprobs
from rlbus.services.policy.tokenizer import encode_prompt
from rlbus.services.tasks.addition import make_split
from tests.unit.conftest import fresh_model

# Two intra-op threads are 5-30x slower on the 2-vCPU machines this runs on.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [encode_prompt(tokenizer, t.prompt) for t in make_split("train", 6, seed=11)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("policy") / "tiny"
    init_model(out, seed=0, max_warm_steps=2, log=lambda _: None)
    return out


def _flat(groups: list[list[SampleOut]]) -> list[SampleOut]:
    return [s for g in groups for s in g]


def _pairs(prompts: list[list[int]], groups: list[list[SampleOut]]) -> list[tuple[list[int], list[int]]]:
    return [(prompts[i], s.completion_ids) for i, g in enumerate(groups) for s in g]


# --- tokenizer ---------------------------------------------------------------------------


def test_tokenizer_round_trips_exactly_and_adds_nothing(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    text = "123+456=579 What is (7*8)-2? Yes, 54!"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)  # one token per character, no <bos>/<eos> added
    assert tokenizer.decode(ids) == text
    assert tokenizer.pad_token_id == 0
    assert {tokenizer.bos_token_id, tokenizer.eos_token_id}.isdisjoint(ids)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded.encode(text) == ids
    assert reloaded.decode(ids) == text
    assert encode_prompt(reloaded, "1+2=") == [tokenizer.bos_token_id, *tokenizer.encode("1+2=")]


# --- sampled distribution ----------------------------------------------------------------


def test_processed_logprobs_applies_temperature(model) -> None:  # type: ignore[no-untyped-def]
    logits = torch.randn(3, 5, 17)
    out = processed_logprobs(logits, temperature=0.5, top_p=1.0)
    assert torch.allclose(out, torch.log_softmax(logits / 0.5, dim=-1))
    assert torch.allclose(out.exp().sum(-1), torch.ones(3, 5))


def test_processed_logprobs_top_p_keeps_the_nucleus_and_renormalises() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    out = processed_logprobs(probs.log(), temperature=1.0, top_p=0.7)
    # 0.5 alone is below 0.7, so 0.3 joins; 0.5+0.3 reaches it, so 0.15 and 0.05 are out.
    assert torch.isinf(out[0, 0]) and torch.isinf(out[0, 2])
    assert torch.allclose(out[0, [1, 3]].exp(), torch.tensor([0.5, 0.3]) / 0.8)
    assert torch.allclose(out.exp().sum(-1), torch.ones(1))
    tiny_p = processed_logprobs(probs.log(), temperature=1.0, top_p=0.01)
    assert tiny_p[0, 1] == 0.0 and torch.isinf(tiny_p[0, [0, 2, 3]]).all()


def test_processed_logprobs_rows_sum_to_one_and_carry_gradients() -> None:
    logits = torch.randn(4, 80, requires_grad=True)
    out = processed_logprobs(logits, temperature=0.8, top_p=0.9)
    assert torch.allclose(out.exp().sum(-1), torch.ones(4), atol=1e-6)
    finite = out[torch.isfinite(out)]
    finite.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_processed_logprobs_greedy_is_a_point_mass() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0]], dtype=torch.bfloat16)
    out = processed_logprobs(logits, temperature=0.0, top_p=1.0)
    assert out.dtype == torch.float32
    assert out[0, 1] == 0.0 and torch.isinf(out[0, [0, 2]]).all()


def test_sampling_params_reject_bad_values() -> None:
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(stop_token_ids=[2, 3]).stop_token_ids == (2, 3)  # type: ignore[arg-type]


# --- sampler vs recompute ----------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampler_logprobs_match_the_trainer_recompute(model, prompts, temperature: float, top_p: float) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=6)
    groups = GroupSampler(StaticSlot(model, 4)).sample_groups(prompts, 4, params, torch.Generator().manual_seed(0))
    assert len(groups) == len(prompts) and all(len(g) == 4 for g in groups)
    recomputed = completion_logprobs(model, _pairs(prompts, groups), params)
    for sample, lp in zip(_flat(groups), recomputed, strict=True):
        assert sample.behaviour_logprobs.dtype == np.float32
        assert sample.token_versions.dtype == np.int64
        assert len(sample.completion_ids) == len(sample.behaviour_logprobs) == len(sample.token_versions)
        assert (sample.token_versions == 4).all()
        assert np.isfinite(sample.behaviour_logprobs).all()  # sampled tokens are inside the nucleus
        assert np.abs(sample.behaviour_logprobs - lp.numpy()).max() < 1e-5


def test_left_padded_prompts_of_different_lengths_sample_correctly(model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [encode_prompt(tokenizer, p) for p in ("1+2=", "123+456=", "(9*9)-1=", "7=")]
    params = SamplingParams(max_new_tokens=7)
    groups = GroupSampler(StaticSlot(model)).sample_groups(prompts, 3, params, torch.Generator().manual_seed(1))
    recomputed = completion_logprobs(model, _pairs(prompts, groups), params)
    for sample, lp in zip(_flat(groups), recomputed, strict=True):
        assert np.abs(sample.behaviour_logprobs - lp.numpy()).max() < 1e-5


def test_stop_tokens_end_a_sample_and_are_kept(model, prompts, tokenizer) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=tuple(tokenizer.encode("0123456789")))
    groups = GroupSampler(StaticSlot(model)).sample_groups(prompts, 8, params, torch.Generator().manual_seed(2))
    stops = set(params.stop_token_ids) | {tokenizer.eos_token_id}
    for s in _flat(groups):
        hits = [i for i, t in enumerate(s.completion_ids) if t in stops]
        if s.finish_reason == "stop":
            assert hits == [len(s.completion_ids) - 1]
        else:
            assert not hits and len(s.completion_ids) == params.max_new_tokens


def test_same_generator_seed_gives_the_same_samples(model, prompts) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_new_tokens=5)
    sampler = GroupSampler(StaticSlot(model))
    a = sampler.sample_groups(prompts, 4, params, torch.Generator().manual_seed(5))
    b = sampler.sample_groups(prompts, 4, params, torch.Generator().manual_seed(5))
    assert [s.completion_ids for s in _flat(a)] == [s.completion_ids for s in _flat(b)]
    c = sampler.sample_groups(prompts, 4, SamplingParams(max_new_tokens=5, seed=9))
    d = sampler.sample_groups(prompts, 4, SamplingParams(max_new_tokens=5, seed=9))
    assert [s.completion_ids for s in _flat(c)] == [s.completion_ids for s in _flat(d)]


def test_deterministic_mode_is_bit_identical_to_the_trainer_with_grad(model, prompts) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=6)
    sampler = GroupSampler(StaticSlot(model, 2), deterministic=True)
    groups = sampler.sample_groups(prompts, 3, params, torch.Generator().manual_seed(3))
    trainer_side = completion_logprobs(model, _pairs(prompts, groups), params, deterministic=True, grad=True)
    for sample, lp in zip(_flat(groups), trainer_side, strict=True):
        assert sample.logprobs_source == "decoded"  # decoded in the trainer's layout: no recompute
        assert lp.requires_grad
        assert torch.equal(torch.from_numpy(sample.behaviour_logprobs), lp.detach())
    assert model.config._attn_implementation == "sdpa"  # eager was only borrowed


def test_deterministic_recompute_does_not_depend_on_the_batch(model, prompts) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams()
    pairs = [(p, p[1:] + [3, 4]) for p in prompts]
    together = completion_logprobs(model, pairs, params, deterministic=True)
    alone = [completion_logprobs(model, [pair], params, deterministic=True)[0] for pair in reversed(pairs)]
    assert all(torch.equal(a, b) for a, b in zip(together, reversed(alone), strict=True))


class _SwapOnceSlot:
    """Returns True on the `swap_on_call`-th call of maybe_swap, after perturbing the weights."""

    def __init__(self, model: torch.nn.Module, swap_on_call: int) -> None:
        self.model = model
        self.version = 0
        self.calls = 0
        self.swap_on_call = swap_on_call

    def maybe_swap(self) -> bool:
        self.calls += 1
        if self.calls != self.swap_on_call:
            return False
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(99)) * 0.05)
        self.version += 1
        return True


@pytest.mark.parametrize("deterministic", [False, True])
def test_tokens_record_a_mid_sequence_weight_swap(tokenizer, prompts, deterministic: bool) -> None:  # type: ignore[no-untyped-def]
    model = fresh_model(tokenizer, seed=1)
    old = fresh_model(tokenizer, seed=1)
    # Call 1 is before the prefill; call k+1 is after token k: swap after 2 tokens.
    slot = _SwapOnceSlot(model, swap_on_call=3)
    params = SamplingParams(max_new_tokens=6)
    groups = GroupSampler(slot, deterministic=deterministic).sample_groups(
        prompts, 8, params, torch.Generator().manual_seed(4)
    )
    samples = _flat(groups)
    long = [(i, s) for i, s in enumerate(samples) if len(s.completion_ids) > 2]
    assert long, "no sample outlived the swap; change the seed"
    old_lp = completion_logprobs(old, _pairs(prompts, groups), params)
    new_lp = completion_logprobs(model, _pairs(prompts, groups), params)
    for i, s in long:
        assert s.token_versions.tolist() == [0, 0] + [1] * (len(s.completion_ids) - 2)
        # Before the swap the old weights sampled; after it, the new ones on the full prefix.
        assert np.abs(s.behaviour_logprobs[:2] - old_lp[i][:2].numpy()).max() < 1e-5
        assert np.abs(s.behaviour_logprobs[2:] - new_lp[i][2:].numpy()).max() < 1e-5
        assert s.logprobs_source == "incremental"  # spans two versions: cannot be recomputed
    short = [(i, s) for i, s in enumerate(samples) if len(s.completion_ids) <= 2]
    for _, s in short:
        assert (s.token_versions == 0).all()
        # Deterministic decoding finished these on version 0 in the trainer's layout: exact there.
        assert s.logprobs_source == ("decoded" if deterministic else "incremental")
    if deterministic and short:
        exact_old = completion_logprobs(old, _pairs(prompts, groups), params, deterministic=True)
        for i, s in short:
            assert torch.equal(torch.from_numpy(s.behaviour_logprobs), exact_old[i])


def test_when_cheaper_swaps_mid_sequence_only_while_more_tokens_remain_than_the_prefix(tokenizer, prompts) -> None:  # type: ignore[no-untyped-def]
    width = max(len(p) for p in prompts)
    # Short completions: the prefix to rebuild is longer than what is left, so the batch
    # finishes on the weights it started with; maybe_swap is not even asked mid-sequence.
    slot = _SwapOnceSlot(fresh_model(tokenizer, seed=1), swap_on_call=2)
    groups = GroupSampler(slot, mid_sequence_swap="when_cheaper").sample_groups(
        prompts, 4, SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(4))
    assert slot.calls == 1 and slot.version == 0
    assert all((s.token_versions == 0).all() for s in _flat(groups))
    # Long enough that tokens left after the first outnumber the prefix: the swap happens at
    # the first decode step (call 2), so tokens from the second one on carry version 1.
    slot = _SwapOnceSlot(fresh_model(tokenizer, seed=1), swap_on_call=2)
    long = 2 * width + 4
    params = SamplingParams(max_new_tokens=long, stop_token_ids=())
    groups = GroupSampler(slot, mid_sequence_swap="when_cheaper").sample_groups(
        [p for p in prompts if len(p) == width][:1], 2, params, torch.Generator().manual_seed(4))
    assert slot.version == 1
    for s in _flat(groups):
        if len(s.completion_ids) > 1:
            assert s.token_versions.tolist()[:2] == [0, 1]


def test_sampler_and_recompute_reject_bad_input(model, prompts) -> None:  # type: ignore[no-untyped-def]
    sampler = GroupSampler(StaticSlot(model))
    with pytest.raises(SamplerInputError, match="empty"):
        sampler.sample_groups([[]], 2, SamplingParams())
    with pytest.raises(SamplerInputError, match="at least one"):
        sampler.sample_groups(prompts, 0, SamplingParams())
    with pytest.raises(SamplerInputError, match="max_position_embeddings"):
        sampler.sample_groups(prompts, 1, SamplingParams(max_new_tokens=60))
    with pytest.raises(SamplerInputError, match="outside the vocabulary"):
        sampler.sample_groups([[1, 10_000]], 1, SamplingParams())
    with pytest.raises(LogprobInputError, match="outside the vocabulary"):
        completion_logprobs(model, [(prompts[0], [-1])], SamplingParams())
    with pytest.raises(LogprobInputError, match="empty prompt"):
        completion_logprobs(model, [([], [1, 2])], SamplingParams())
    assert completion_logprobs(model, [(prompts[0], [])], SamplingParams())[0].numel() == 0


# --- loading and weight swaps ------------------------------------------------------------


def test_init_model_writes_a_loadable_hugging_face_folder(model_dir: Path) -> None:
    assert (model_dir / "model.safetensors").is_file()
    assert (model_dir / "config.json").is_file()
    assert (model_dir / "generation_config.json").is_file()
    info = json.loads((model_dir / "rlbus_model.json").read_text())
    assert {"seed", "warm_start_steps", "heldout_accuracy", "seconds"} <= set(info)
    assert info["warm_start_steps"] == 2
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    hf_tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert hf_model.config.model_type == "qwen2" and not hf_model.config.tie_word_embeddings
    assert hf_model.lm_head.weight.data_ptr() != hf_model.model.embed_tokens.weight.data_ptr()
    assert hf_model.config.vocab_size == len(hf_tok)
    assert hf_tok.decode(hf_tok.encode("321+123=444")) == "321+123=444"


def test_load_tokenizer_gives_the_saved_ids_where_auto_tokenizer_does_not(model_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "What is 12 + 3? 15"
    loaded = load_tokenizer(model_dir)
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    # Why the loader exists: transformers swaps in Qwen2's own class for this folder, which drops
    # the spaces.  If this starts to hold, AutoTokenizer is safe again and the loader can go.
    auto = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert auto.encode(text, add_special_tokens=False) != tokenizer.encode(text, add_special_tokens=False)


def test_init_model_is_deterministic_and_refuses_to_clobber(tmp_path: Path, model_dir: Path) -> None:
    init_model(tmp_path / "again", seed=0, max_warm_steps=2, log=lambda _: None)
    a, _ = load_policy(model_dir)
    b, _ = load_policy(tmp_path / "again")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    with pytest.raises(ModelInitError, match="overwrite"):
        init_model(tmp_path / "again", max_warm_steps=1, log=lambda _: None)


def test_load_policy_modes(model_dir: Path, tmp_path: Path) -> None:
    model, tok = load_policy(model_dir)
    assert not model.training and next(model.parameters()).dtype == torch.float32
    bf16, _ = load_policy(model_dir, dtype="bfloat16", attn="eager")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert bf16.config._attn_implementation == "eager"
    with pytest.raises(PolicyLoadError, match="config.json"):
        load_policy(tmp_path / "nothing-here")


def test_weight_swap_from_safetensors_bytes_and_files(model_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    live, _ = load_policy(model_dir)
    other = fresh_model(tokenizer, seed=7)
    payload = save_safetensors({k: v.contiguous() for k, v in other.state_dict().items()})
    assert load_state_from_safetensors(live, payload) == len(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(live.state_dict().values(), other.state_dict().values(), strict=True))
    assert load_state_from_safetensors(live, model_dir / "model.safetensors") > 0
    assert load_state_from_safetensors(live, model_dir) > 0  # a folder works too
    reference, _ = load_policy(model_dir)
    assert all(
        torch.equal(a, b) for a, b in zip(live.state_dict().values(), reference.state_dict().values(), strict=True)
    )


def test_weight_swap_refuses_bad_payloads_without_touching_the_model(model_dir: Path) -> None:
    live, _ = load_policy(model_dir)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    good = {k: v.clone() + 1.0 for k, v in live.state_dict().items()}

    wrong_shape = dict(good)
    wrong_shape["model.layers.3.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightMismatchError, match="model.layers.3.mlp.up_proj.weight") as err:
        load_state_from_safetensors(live, wrong_shape)
    assert err.value.tensor == "model.layers.3.mlp.up_proj.weight"

    missing = {k: v for k, v in good.items() if k != "lm_head.weight"}
    with pytest.raises(WeightMismatchError, match="lm_head.weight"):
        load_state_from_safetensors(live, missing)

    with pytest.raises(WeightMismatchError, match="extra.weight"):
        load_state_from_safetensors(live, {**good, "extra.weight": torch.zeros(1)})

    poisoned = dict(good)
    poisoned["model.norm.weight"] = torch.full_like(good["model.norm.weight"], float("nan"))
    with pytest.raises(WeightMismatchError, match="NaN"):
        load_state_from_safetensors(live, poisoned)

    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())


# --- warm start --------------------------------------------------------------------------


@pytest.mark.slow  # builds the model when the session has not yet (about 90 s)
def test_full_warm_start_lands_partly_right(tiny_model: Path) -> None:
    # tiny_model is exactly `init_model(seed=0)` with the defaults (a full warm start), built once per
    # session for the end-to-end tests: building a second copy here would check the same folder.
    info = json.loads((tiny_model / "rlbus_model.json").read_text())
    print(
        f"warm start: {info['warm_start_steps']} steps, heldout_accuracy {info['heldout_accuracy']:.3f}, "
        f"{info['seconds']:.1f} s in init_model"
    )
    assert 0.2 <= info["heldout_accuracy"] <= 0.6
    model, tok = load_policy(tiny_model)
    # The saved folder reproduces the accuracy the warm start stopped at.
    assert greedy_accuracy(model, tok, make_split("heldout", 200, seed=0)) == info["heldout_accuracy"]
