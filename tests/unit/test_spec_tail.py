"""The speculative tail of the PyTorch sampler (services/policy/spec_tail.py) on the tiny policy.

What must hold with drafting on: greedy samples are exactly the plain sampler's; behaviour
log-probs are the target's processed log-probs (a recompute agrees); stop ids and
max_new_tokens cut where plain decoding does; a weight swap staged mid-tail labels each token
with the version whose forward produced it; the sampled distribution is the plain sampler's
(two-sample chi-square through the real sampler; the acceptance rule alone is chi-square tested
in test_speculative.py). The tail engages only at <= tail_rows rows, so these calls are small.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from rlbus.schemas.metric_keys import SpeculativeKeys
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.policy.load import load_policy
from rlbus.services.policy.logprobs import completion_logprobs
from rlbus.services.policy.sampler import GroupSampler, StaticSlot, _stop_ids
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.policy.spec_tail import DraftLength, Speculation, SpeculationConfig, SpeculationConfigError
from rlbus.services.policy.tokenizer import encode_prompt
from rlbus.services.runtime.config import ConfigError, load_section
from tests.unit.conftest import fresh_model
from tests.unit.stats import same_distribution_p

PROMPTS = ("123+456=", "7+95=", "400+600=", "58+67=")


@pytest.fixture(scope="module")
def policy(tiny_model: Path):
    torch.set_num_threads(1)
    return load_policy(tiny_model)


def _spec(tail_rows: int = 4, max_k: int = 4) -> Speculation:
    return Speculation(SpeculationConfig(drafter="group", tail_rows=tail_rows, max_k=max_k))


def _ids(groups) -> list[list[int]]:
    return [s.completion_ids for g in groups for s in g]


def test_greedy_with_drafting_equals_plain_greedy(policy) -> None:
    model, tok = policy
    prompts = [encode_prompt(tok, t) for t in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    plain = _ids(GroupSampler(StaticSlot(model)).sample_groups(prompts, 1, params))
    spec = _spec()
    # The pool holds half the answers and a near miss of the others (one right token, then
    # wrong ones): both branches of the acceptance rule run, and the measured acceptance stays
    # high enough for the second call to draft as well.
    for i, c in enumerate(plain):
        spec.recent.add(c if i % 2 else [c[0], c[1], (c[2] + 1) % 10, 3, 3, 3])
    sampler = GroupSampler(StaticSlot(model), speculation=spec)
    drafted = kept = 0
    for _ in range(2):
        assert _ids(sampler.sample_groups(prompts, 1, params)) == plain
        drafted, kept = drafted + spec.last_call.drafted, kept + spec.last_call.kept
        assert spec.last_call.rounds > 0
    assert 0 < kept < drafted


def test_greedy_long_generations_of_an_untrained_policy(policy) -> None:
    """An untrained policy repeats itself: long accepted drafts from its own earlier tokens,
    rows of different lengths in one tail batch, rows leaving it at the budget."""
    _, tok = policy
    model = fresh_model(tok, seed=3)
    prompts = [encode_prompt(tok, t) for t in PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    plain = _ids(GroupSampler(StaticSlot(model)).sample_groups(prompts, 2, params))
    spec = _spec()
    assert _ids(GroupSampler(StaticSlot(model), speculation=spec).sample_groups(prompts, 2, params)) == plain
    assert spec.last_call.kept > 0 and spec.last_call.metrics()["tokens_per_forward"] > 1.0


class _DraftsAtSixRows(DraftLength):
    """k = 4 at 6 rows or fewer and 0 above, whatever the acceptance: a tail entered at 8 rows
    decodes without drafts (plain rounds) until two of its rows stop, then drafts."""

    def k(self, rows: int) -> int:
        return self.max_k if rows <= 6 else 0


def test_rounds_without_drafts_decode_as_the_plain_loop(policy) -> None:
    """A tail whose drafters draft nothing at its row count takes plain rounds (one token per row,
    vectorised): greedy ids equal plain greedy and sampled tokens carry the target's log-probs, with
    prompts of different lengths (masked columns), rows stopping at different steps and rows at the
    budget; once fewer rows are left it drafts again (from the previous call's completions)."""
    model, tok = policy
    prompts = [encode_prompt(tok, t) for t in PROMPTS]  # the tiny policy's answers: 4 tokens for one, 5 for three
    spec = Speculation(SpeculationConfig(drafter="group", tail_rows=8, max_k=4), lengths=_DraftsAtSixRows(4))
    spec.wants_tail = lambda live_rows: live_rows <= 8  # type: ignore[method-assign]  # enter at 8 rows, k = 0
    sampler = GroupSampler(StaticSlot(model), speculation=spec)
    for budget in (3, 8, 8):
        params = SamplingParams(temperature=0.0, max_new_tokens=budget)
        plain = _ids(GroupSampler(StaticSlot(model)).sample_groups(prompts, 2, params))
        assert _ids(sampler.sample_groups(prompts, 2, params)) == plain
        assert spec.last_call.rounds > 0
    assert spec.last_call.drafted > 0
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)
    groups = sampler.sample_groups(prompts, 2, params, generator=torch.Generator().manual_seed(5))
    pairs = [(prompts[i], s.completion_ids) for i, g in enumerate(groups) for s in g]
    for s, ref in zip([s for g in groups for s in g], completion_logprobs(model, pairs, params), strict=True):
        assert torch.allclose(torch.as_tensor(s.behaviour_logprobs), ref.float(), atol=1e-4), (s, ref)
        assert (s.token_versions == 0).all()


def test_behaviour_logprobs_are_the_targets_processed_logprobs(policy) -> None:
    model, tok = policy
    prompts = [encode_prompt(tok, t) for t in PROMPTS[:2]]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)
    spec = _spec()
    gen = torch.Generator().manual_seed(11)
    for c in _ids(GroupSampler(StaticSlot(model)).sample_groups(prompts, 8, params, generator=gen)):
        spec.recent.add(c)  # earlier groups of the same prompts: drafts that are often right
    sampler = GroupSampler(StaticSlot(model), speculation=spec)
    drafted = kept = 0
    for _ in range(4):
        groups = sampler.sample_groups(prompts, 2, params, generator=gen)
        drafted, kept = drafted + spec.last_call.drafted, kept + spec.last_call.kept
        pairs = [(prompts[i], s.completion_ids) for i, g in enumerate(groups) for s in g]
        recomputed = completion_logprobs(model, pairs, params)
        for s, ref in zip([s for g in groups for s in g], recomputed, strict=True):
            assert torch.allclose(torch.as_tensor(s.behaviour_logprobs), ref.float(), atol=1e-4), (s, ref)
            assert (s.token_versions == 0).all()
    assert 0 < kept < drafted  # drafts were verified, some kept and some rejected


def test_stop_ids_and_budget_cut_where_plain_decoding_does(policy) -> None:
    model, tok = policy
    prompts = [encode_prompt(tok, t) for t in PROMPTS]
    plain_params = SamplingParams(temperature=0.0, max_new_tokens=8)
    answers = _ids(GroupSampler(StaticSlot(model)).sample_groups(prompts, 1, plain_params))
    # A digit that occurs inside answers becomes a stop id, so drafts run past it (they are copied
    # from whole answers); a budget of 3 is shorter than most answers, so drafts run past it too.
    digit = Counter(t for a in answers for t in a[1:-1]).most_common(1)[0][0]
    for params in (SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(digit,)),
                   SamplingParams(temperature=0.0, max_new_tokens=3)):
        spec = _spec()
        for a in answers:
            spec.recent.add(a)
        plain = GroupSampler(StaticSlot(model)).sample_groups(prompts, 1, params)
        out = GroupSampler(StaticSlot(model), speculation=spec).sample_groups(prompts, 1, params)
        assert spec.last_call.kept > 0
        stops = set(_stop_ids(model, params))
        for p, s in zip(_ids(plain), [s for g in out for s in g], strict=True):
            assert s.completion_ids == p
            assert len(s.completion_ids) <= params.max_new_tokens
            assert not stops & set(s.completion_ids[:-1])  # nothing emitted after a stop id
            assert s.finish_reason == ("stop" if s.completion_ids[-1] in stops else "length")
            assert len(s.behaviour_logprobs) == len(s.token_versions) == len(s.completion_ids)


class SwapAt:
    """A slot that installs `new` (version 1) at its `at`-th maybe_swap call."""

    def __init__(self, old, new, at: int) -> None:
        self.model, self.version, self._new, self._at, self.calls = old, 0, new, at, 0

    def maybe_swap(self) -> bool:
        self.calls += 1
        if self.calls == self._at:
            self.model, self.version = self._new, 1
            return True
        return False


def test_weight_swap_mid_tail_labels_tokens_honestly(policy) -> None:
    _, tok = policy
    # Untrained policies: long completions, so rows are still decoding when the swap lands.
    old, new = fresh_model(tok, seed=4), fresh_model(tok, seed=5)
    prompts = [encode_prompt(tok, t) for t in PROMPTS[:2]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    spec = _spec()
    earlier = GroupSampler(StaticSlot(old)).sample_groups(prompts, 4, params, generator=torch.Generator().manual_seed(1))
    for c in _ids(earlier):  # something to draft from
        spec.recent.add(c)
    # Call 1 is the sampler's start-of-call check; the tail starts after the first token (2 rows
    # <= tail_rows) and each of its rounds checks once: call 3 swaps before the 2nd round.
    slot = SwapAt(old, new, at=3)
    out = GroupSampler(slot, mid_sequence_swap="next_step", speculation=spec).sample_groups(
        prompts, 1, params, generator=torch.Generator().manual_seed(2))
    samples = [s for g in out for s in g]
    assert slot.calls >= 3 and spec.last_call.rounds >= 2
    pairs = [(prompts[i], s.completion_ids) for i, s in enumerate(samples)]
    under = {0: completion_logprobs(old, pairs, params), 1: completion_logprobs(new, pairs, params)}
    both = False
    for i, s in enumerate(samples):
        versions = s.token_versions.tolist()
        assert versions == sorted(versions)  # old weights, then new ones: never back
        both |= versions[0] == 0 and versions[-1] == 1
        for j, v in enumerate(versions):
            # Each token's behaviour log-prob is the processed log-prob under the version it names.
            assert abs(float(s.behaviour_logprobs[j]) - float(under[v][i][j])) < 1e-4, (i, j, v)
    assert both


def test_sampled_distribution_matches_plain_sampling(policy) -> None:
    """Two-sample chi-square over whole completions, false-alarm rate 1e-3 (fixed seed); the tail
    runs from the first token (1 row a call), drafting from recent completions."""
    model, tok = policy
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=5)
    prompt = encode_prompt(tok, "58+67=")
    rows = 500
    gen = torch.Generator().manual_seed(5)
    plain = [tuple(s.completion_ids) for s in
             GroupSampler(StaticSlot(model)).sample_groups([prompt], rows, params, generator=gen)[0]]
    spec = _spec(tail_rows=1)
    sampler = GroupSampler(StaticSlot(model), speculation=spec)
    drafted = kept = 0
    got = []
    for _ in range(rows):
        got.append(tuple(sampler.sample_groups([prompt], 1, params, generator=gen)[0][0].completion_ids))
        drafted, kept = drafted + spec.last_call.drafted, kept + spec.last_call.kept
    assert 0 < kept < drafted
    p_value = same_distribution_p(plain, got)
    assert p_value > 1e-3, (p_value, Counter(plain).most_common(5), Counter(got).most_common(5))


def test_draft_length_follows_acceptance_and_rows() -> None:
    length = DraftLength(max_k=4)
    assert length.k(1) == 4  # the prior (0.5) pays at 1 row
    assert length.k(2) >= length.k(64) and length.k(64) == 0  # a verify forward over many rows does not pay
    for _ in range(40):
        length.observe(kept=0, trials=2)  # every draft rejected
    assert length.k(1) == 0
    for _ in range(200):
        length.observe(kept=0, trials=0)  # rounds without drafts: back towards the prior
    assert length.k(1) > 0
    for _ in range(40):
        length.observe(kept=3, trials=3)
    assert length.k(1) == 4


def test_settings_validation_says_the_fix(monkeypatch, tiny_model: Path) -> None:
    for key in [k for k in __import__("os").environ if k.startswith("RLBUS_")]:
        monkeypatch.delenv(key)
    assert GeneratorSettings().speculative.drafter == "off"
    # The vllm backend drafts with vLLM's n-gram drafter ("group"); a draft model needs the torch backend.
    vllm = load_section(GeneratorSettings, {"generator": {"backend": "vllm", "speculative": {"drafter": "group"}}},
                        "generator")
    assert vllm.speculative.drafter == "group"
    with pytest.raises(ConfigError) as info:
        load_section(GeneratorSettings, {"generator": {"backend": "vllm", "speculative": {
            "drafter": "model", "draft_model_path": str(tiny_model)}}}, "generator")
    assert 'needs backend = "torch"' in str(info.value)
    assert "n-gram" in str(info.value) and '"off"' in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_section(GeneratorSettings, {"generator": {"speculative": {"drafter": "group", "k": 3}}}, "generator")
    assert "[generator.speculative] unknown key 'k'" in str(info.value) and "max_k" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_section(GeneratorSettings, {"generator": {"speculative": {"drafter": "medusa"}}}, "generator")
    assert "[generator.speculative] drafter" in str(info.value)
    # The tail is the batch sampler's: asking for single-turn episodes with a drafter on says which to drop.
    with pytest.raises(ConfigError) as info:
        load_section(GeneratorSettings, {"generator": {"single_turn": "episodes", "speculative": {"drafter": "group"}}},
                     "generator")
    assert 'single_turn = "batch"' in str(info.value) and 'drafter = "off"' in str(info.value)
    drafting = load_section(GeneratorSettings, {"generator": {"speculative": {"drafter": "group"}}}, "generator")
    assert drafting.single_turn == "episodes"  # the default stands; the batch driver keeps the tasks (test_generator_episodes)
    with pytest.raises(ConfigError) as info:
        load_section(GeneratorSettings, {"generator": {"speculative": {"tail_rows": 0}}}, "generator")
    assert "[generator.speculative] tail_rows" in str(info.value) and "rows" in str(info.value)
    with pytest.raises(SpeculationConfigError, match="max_k=0"):
        SpeculationConfig(drafter="group", max_k=0)


def test_an_unknown_drafter_combination_is_refused_with_the_valid_names(monkeypatch) -> None:
    for key in [k for k in __import__("os").environ if k.startswith("RLBUS_")]:
        monkeypatch.delenv(key)
    for wrong in ("group+model", "model+static", "group+static", "model+group+group"):
        with pytest.raises(ConfigError) as info:
            load_section(GeneratorSettings, {"generator": {"speculative": {"drafter": wrong}}}, "generator")
        assert "[generator.speculative] drafter" in str(info.value) and f"got '{wrong}'" in str(info.value)
        assert "'model+group'" in str(info.value) and "'static+group'" in str(info.value)
        with pytest.raises(SpeculationConfigError, match=r"only as 'model\+group' or 'static\+group'"):
            SpeculationConfig(drafter=wrong)  # type: ignore[arg-type]
    # The combinations that exist need a draft model like "model" and "static" do.
    for combined in ("model+group", "static+group"):
        with pytest.raises(ConfigError, match="needs draft_model_path"):
            load_section(GeneratorSettings, {"generator": {"speculative": {"drafter": combined}}}, "generator")
        assert SpeculationConfig(drafter=combined).drafter == combined


def test_backend_reports_the_tail_on_its_metrics(tiny_model: Path) -> None:
    from rlbus.services.generator.torch_backend import TorchBackend

    backend = TorchBackend(str(tiny_model), speculative={"drafter": "group", "tail_rows": 4, "max_k": 4})

    class Sampling:
        temperature, top_p, max_new_tokens = 1.0, 1.0, 8

    backend.sample([encode_prompt(backend.tokenizer, "7+95=")], 2, Sampling(), [], seed=1)
    metrics = backend.metrics()
    keys = [v for k, v in vars(SpeculativeKeys).items() if k.isupper()]
    assert all(k in metrics for k in keys)
    assert metrics[SpeculativeKeys.TAIL_TOKENS] > 0 and metrics[SpeculativeKeys.VERIFY_S] > 0
    off = TorchBackend(str(tiny_model))
    assert not any(k.startswith("generator/spec/") for k in off.metrics())


def test_tail_stats_add_sums_counts_and_times_but_not_the_last_k() -> None:
    from rlbus.services.policy.spec_tail import TailStats

    total = TailStats(rounds=1, tokens=3, drafted=4, kept=2, draft_s=0.5, k_last=3)
    total.add(TailStats(rounds=2, tokens=5, drafted=1, kept=1, drafting_rows=1, draft_s=0.25, verify_s=1.0, k_last=1))
    assert (total.rounds, total.tokens, total.drafted, total.kept, total.drafting_rows) == (3, 8, 5, 3, 1)
    assert (total.draft_s, total.verify_s, total.k_last) == (0.75, 1.0, 3)
