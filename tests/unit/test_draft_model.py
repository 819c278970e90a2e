"""The draft model (services/policy/draft_model.py), the `model` / `static` drafters in the sampler's
speculative tail (services/policy/model_drafter.py, spec_tail.py) and draft distillation
(services/policy/distill.py), on the tests' tiny addition policy.

What must hold: a draft built from the policy shares its vocabulary and context and round-trips
through a Hugging Face folder; a draft that does not fit is refused at start-up with the fix;
with a sampled (stochastic) drafter the sampler's output is still the policy's (greedy ids equal,
behaviour log-probs are the target's, a chi-square against plain sampling); a draft version staged
mid-call is swapped in between target forwards; distillation raises the real acceptance rate.
The combined drafter ("model+group": each row takes the group's suffix match where there is one,
else the draft model's sample) keeps the same promises with both kinds of row in one verify
round, and counts what each source drafted and kept.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.policy.distill import DistillInputError, DraftDistiller, PolicySample
from rlbus.services.policy.draft_model import DraftModelError, build_draft, load_draft, save_draft
from rlbus.services.policy.draft_round import RoundDrafts
from rlbus.services.policy.drafters import RecentCompletions
from rlbus.services.policy.load import load_policy
from rlbus.services.policy.logprobs import completion_logprobs
from rlbus.services.policy.model_init import tiny_config
from rlbus.services.policy.sampler import GroupSampler, StaticSlot
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.policy.spec_tail import (
    FixedDraftLength,
    Speculation,
    SpeculationConfig,
    SpeculationConfigError,
    TailDecoder,
    TailStats,
)
from rlbus.services.policy.tokenizer import encode_prompt
from rlbus.services.policy.weight_slot import WeightSlot
from rlbus.services.runtime.config import ConfigError, load_section
from rlbus.services.tasks.addition import make_split
from tests.unit.stats import same_distribution_p

PROMPTS = ("123+456=", "7+95=", "400+600=", "58+67=")


@pytest.fixture(scope="module")
def policy(tiny_model: Path):
    torch.set_num_threads(1)
    return load_policy(tiny_model)


@pytest.fixture(scope="module")
def draft_dir(policy, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = policy
    return save_draft(build_draft(model, layers=2), tok, tmp_path_factory.mktemp("draft") / "d")


def _model_spec(draft, *, tail_rows: int = 4, max_k: int = 4, fixed: bool = False, slot=None,
                drafter: str = "model") -> Speculation:
    return Speculation(SpeculationConfig(drafter=drafter, tail_rows=tail_rows, max_k=max_k),  # type: ignore[arg-type]
                       draft=slot or StaticSlot(draft), lengths=FixedDraftLength(max_k) if fixed else None)


def test_build_copies_the_policys_first_layers_and_round_trips(policy, draft_dir: Path) -> None:
    model, _ = policy
    draft = build_draft(model, layers=2)
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == model.config.vocab_size
    ps, ds = model.state_dict(), draft.state_dict()
    assert set(ds) < set(ps) and all(torch.equal(ds[k], ps[k]) for k in ds)
    fresh = build_draft(model, layers=1, init="fresh", seed=1)
    assert not torch.equal(fresh.state_dict()["model.embed_tokens.weight"], ps["model.embed_tokens.weight"])
    loaded = load_draft(draft_dir, model)
    ids = torch.tensor([[1, 5, 6, 7, 20]])
    assert torch.equal(loaded(input_ids=ids).logits, draft(input_ids=ids).logits)
    with pytest.raises(DraftModelError, match="layers=5: use 1..4"):
        build_draft(model, layers=5)


def test_a_draft_that_does_not_fit_is_refused_with_the_fix(policy, draft_dir: Path, tmp_path: Path) -> None:
    model, tok = policy
    values = {**tiny_config(tok).to_dict(), "num_hidden_layers": 1, "layer_types": None}
    values["vocab_size"] += 8  # a tokenizer with more tokens than the policy's
    other = save_draft(Qwen2ForCausalLM(Qwen2Config(**values)), tok, tmp_path / "other")
    with pytest.raises(DraftModelError, match="vocabulary size .* the policy"):
        Speculation.build(SpeculationConfig(drafter="static", draft_model_path=str(other)), model)
    with pytest.raises(DraftModelError, match="no config.json"):
        Speculation.build(SpeculationConfig(drafter="model", draft_model_path=str(tmp_path)), model)
    with pytest.raises(SpeculationConfigError, match="needs draft_model_path"):
        Speculation.build(SpeculationConfig(drafter="model"), model)
    built = Speculation.build(SpeculationConfig(drafter="static", draft_model_path=str(draft_dir)), model)
    with pytest.raises(SpeculationConfigError, match="drafter = 'model'"):
        built.stage_draft(1, {})
    for options, needle in (({"drafter": "model"}, "needs draft_model_path"),
                            ({"drafter": "static", "draft_model_path": str(tmp_path)}, "no config.json")):
        with pytest.raises(ConfigError, match=needle):
            load_section(GeneratorSettings, {"generator": {"speculative": options}}, "generator")
    ok = load_section(GeneratorSettings, {"generator": {"speculative": {"drafter": "model",
                                                                        "draft_model_path": str(draft_dir)}}}, "generator")
    assert ok.speculative.drafter == "model"


def test_greedy_with_a_draft_model_equals_plain_greedy(policy) -> None:
    model, tok = policy
    prompts = [encode_prompt(tok, t) for t in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    plain = GroupSampler(StaticSlot(model)).sample_groups(prompts, 1, params)
    spec = _model_spec(build_draft(model, layers=2), fixed=True)
    drafted = GroupSampler(StaticSlot(model), speculation=spec).sample_groups(prompts, 1, params)
    assert [s.completion_ids for g in drafted for s in g] == [s.completion_ids for g in plain for s in g]
    assert 0 < spec.last_call.kept < spec.last_call.drafted


def test_behaviour_logprobs_stay_the_targets(policy) -> None:
    model, tok = policy
    prompts = [encode_prompt(tok, t) for t in PROMPTS[:2]]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)
    spec = _model_spec(build_draft(model, layers=2), fixed=True)
    groups = GroupSampler(StaticSlot(model), speculation=spec).sample_groups(
        prompts, 2, params, generator=torch.Generator().manual_seed(3))
    assert 0 < spec.last_call.kept < spec.last_call.drafted
    pairs = [(prompts[i], s.completion_ids) for i, g in enumerate(groups) for s in g]
    for s, ref in zip([s for g in groups for s in g], completion_logprobs(model, pairs, params), strict=True):
        assert torch.allclose(torch.as_tensor(s.behaviour_logprobs), ref.float(), atol=1e-4)


def test_a_mixed_round_keeps_the_targets_logprobs_and_counts_each_source(policy, monkeypatch) -> None:
    """Rows with a group match and rows without one are drafted by different drafters in the same
    round and verified by one forward: every emitted token's behaviour log-prob is still the
    target's processed log-prob, a group row's distribution is one-hot on its proposal, and the
    tail's statistics split drafted and kept tokens by source."""
    model, tok = policy
    rounds: list[RoundDrafts] = []
    drafts = TailDecoder._drafts

    def spy(self, ks):  # type: ignore[no-untyped-def]
        proposed, seconds = drafts(self, ks)
        rounds.append(proposed)
        return proposed, seconds

    monkeypatch.setattr(TailDecoder, "_drafts", spy)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10)
    prompts = [encode_prompt(tok, t) for t in PROMPTS[:2]]
    spec = _model_spec(build_draft(model, layers=1), tail_rows=4, fixed=True, drafter="model+group")
    sampler, gen, total = GroupSampler(StaticSlot(model), speculation=spec), torch.Generator().manual_seed(6), TailStats()
    samples = []
    for _ in range(3):  # later calls also draft from the earlier calls' completions
        groups = sampler.sample_groups(prompts, 2, params, generator=gen)
        samples += [(prompts[i], s) for i, g in enumerate(groups) for s in g]
        total.add(spec.last_call)
    mixed = [r for r in rounds if {"group", "model"} <= set(r.sources)]
    assert mixed, [r.sources for r in rounds]
    for r in mixed:
        assert r.probs is not None
        for i, source in enumerate(r.sources):
            if source == "group":
                one_hot = torch.zeros_like(r.probs[i, : len(r.ids[i])]).scatter_(-1, torch.tensor(r.ids[i])[:, None], 1.0)
                assert torch.equal(r.probs[i, : len(r.ids[i])], one_hot)
            elif source == "model":
                assert torch.allclose(r.probs[i, : len(r.ids[i])].sum(-1), torch.ones(len(r.ids[i])))
    refs = completion_logprobs(model, [(p, s.completion_ids) for p, s in samples], params)
    for (_, s), ref in zip(samples, refs, strict=True):
        assert torch.allclose(torch.as_tensor(s.behaviour_logprobs), ref.float(), atol=1e-4)
    by_source = {src: sum(len(r.ids[i]) for r in rounds for i, x in enumerate(r.sources) if x == src)
                 for src in ("group", "model")}
    assert (total.group_drafted, total.model_drafted) == (by_source["group"], by_source["model"])
    assert total.group_drafted > 0 and total.model_drafted > 0
    assert total.group_kept + total.model_kept == total.kept and total.group_drafted + total.model_drafted == total.drafted
    metrics = total.metrics()
    assert metrics["group_acceptance_rate"] == total.group_kept / total.group_drafted
    assert metrics["model_kept"] == total.model_kept


@pytest.mark.parametrize("drafter", ["model", "model+group"])
def test_sampled_distribution_matches_plain_sampling(policy, drafter: str) -> None:
    """Two-sample chi-square over whole completions, false-alarm rate 1e-3 (fixed seed). The draft
    is an untrained-beyond-its-init 1-layer copy: its q differs from p a lot, so the residual
    draws of the acceptance rule carry much of the distribution. With "model+group" the group
    drafter proposes from the earlier calls' completions (point masses, one-hot in the verify
    round) and the draft model fills the rows it has no match for."""
    model, tok = policy
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=5)
    prompt = encode_prompt(tok, "58+67=")
    rows = 400
    gen = torch.Generator().manual_seed(5)
    plain = [tuple(s.completion_ids) for s in
             GroupSampler(StaticSlot(model)).sample_groups([prompt], rows, params, generator=gen)[0]]
    # Two rows a call, both in the tail from their first token: drafts of both rows are verified
    # in one forward, with their draft distributions side by side.
    spec = _model_spec(build_draft(model, layers=1), tail_rows=2, fixed=True, drafter=drafter)
    sampler = GroupSampler(StaticSlot(model), speculation=spec)
    total = TailStats()
    got = []
    for call in range(rows // 2):
        if call % 2:
            # Every other call starts from an empty pool: the group drafter then has no match
            # for the first round (nor wherever the siblings have none), so the draft model drafts
            # a good share of the rows (with a full pool, ~1% of them: every completion matches).
            spec.recent = RecentCompletions()
        got += [tuple(s.completion_ids) for s in sampler.sample_groups([prompt], 2, params, generator=gen)[0]]
        total.add(spec.last_call)
    assert 0 < total.kept < total.drafted
    assert 0 < total.model_kept < total.model_drafted
    if drafter == "model+group":
        assert 0 < total.group_kept < total.group_drafted
        assert total.group_drafted + total.model_drafted == total.drafted
    p_value = same_distribution_p(plain, got)
    assert p_value > 1e-3, (p_value, Counter(plain).most_common(5), Counter(got).most_common(5))


class StageAt(StaticSlot):
    """The target's slot; at its `at`-th maybe_swap (the tail asks once per round) a new draft
    version arrives, as a weight broadcast would deliver it to a running generator."""

    def __init__(self, model, spec: Speculation, payload: bytes, at: int) -> None:
        super().__init__(model)
        self.spec, self.payload, self.at, self.calls = spec, payload, at, 0

    def maybe_swap(self) -> bool:
        self.calls += 1
        if self.calls == self.at:
            self.spec.stage_draft(1, self.payload)
        return False


def test_a_draft_version_staged_mid_call_is_swapped_in_between_target_forwards(policy) -> None:
    model, tok = policy
    old = build_draft(model, layers=1)
    new = build_draft(model, layers=1, init="fresh", seed=7)
    spec = _model_spec(old, tail_rows=1, fixed=True, slot=WeightSlot(old, 0))
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    prompt = encode_prompt(tok, "123+456=")
    slot = StageAt(model, spec, save_safetensors({k: v.clone() for k, v in new.state_dict().items()}), at=3)
    out = GroupSampler(slot, speculation=spec).sample_groups([prompt], 1, params, generator=torch.Generator().manual_seed(2))
    sample = out[0][0]
    assert spec.last_call.rounds >= 3 and spec.last_call.draft_swaps == 1 and spec.draft.version == 1
    assert torch.equal(spec.draft.model.state_dict()["model.embed_tokens.weight"], new.state_dict()["model.embed_tokens.weight"])
    # The target never changed: every token's behaviour log-prob is still the policy's.
    ref = completion_logprobs(model, [(prompt, sample.completion_ids)], params)[0]
    assert torch.allclose(torch.as_tensor(sample.behaviour_logprobs), ref.float(), atol=1e-4)
    assert (sample.token_versions == 0).all()


def test_backend_builds_the_draft_from_settings(tiny_model: Path, draft_dir: Path) -> None:
    from rlbus.services.generator.torch_backend import TorchBackend

    backend = TorchBackend(str(tiny_model), speculative={"drafter": "model", "tail_rows": 4, "max_k": 4,
                                                         "draft_model_path": str(draft_dir)})

    class Sampling:
        temperature, top_p, max_new_tokens = 1.0, 1.0, 8

    backend.sample([encode_prompt(backend.tokenizer, "7+95=")], 2, Sampling(), [], seed=1)
    assert backend.metrics()["generator/spec/tail_tokens"] > 0
    draft = backend.speculation.draft.model
    backend.stage_draft(3, save_safetensors({k: v.clone() for k, v in draft.state_dict().items()}))
    assert backend.speculation.draft.maybe_swap() and backend.speculation.draft.version == 3
    # A call that drafts nothing (one token each: no room for a draft) still takes a staged draft
    # in at its start: the draft in use never waits for the next call that drafts.
    backend.stage_draft(4, save_safetensors({k: v.clone() for k, v in draft.state_dict().items()}))

    class Greedy:
        temperature, top_p, max_new_tokens = 0.0, 1.0, 1

    backend.sample([encode_prompt(backend.tokenizer, "7+95=")], 2, Greedy(), [], seed=1)
    assert backend.draft_version == 4


def _acceptance(model, draft, prompts, params, seed: int) -> float:
    """The real acceptance rule in the real sampler: one row per call from its first token, k = 4."""
    spec = _model_spec(draft, tail_rows=1, fixed=True)
    sampler = GroupSampler(StaticSlot(model), speculation=spec)
    total, gen = TailStats(), torch.Generator().manual_seed(seed)
    for p in prompts:
        sampler.sample_groups([p], 1, params, generator=gen)
        total.add(spec.last_call)
    return total.kept / total.drafted


def test_distillation_on_policy_samples_raises_acceptance(policy) -> None:
    model, tok = policy
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    train = [encode_prompt(tok, t.prompt) for t in make_split("train", 64, 3)]
    heldout = [encode_prompt(tok, t.prompt) for t in make_split("heldout", 24, 1)]
    groups = GroupSampler(StaticSlot(model)).sample_groups(train, 8, params, generator=torch.Generator().manual_seed(1))
    samples = [PolicySample(p, s.completion_ids) for p, g in zip(train, groups, strict=True) for s in g]
    draft = build_draft(model, layers=1)
    before = _acceptance(model, draft, heldout, params, seed=0)
    losses = DraftDistiller(draft).fit(samples, steps=30)
    after = _acceptance(model, draft, heldout, params, seed=0)
    # Measured with this setup over 3 seeds (policy samples, minibatch order, acceptance draws):
    # 0.06-0.08 before, 0.22-0.24 after, a gap of 0.14-0.17. A 1-layer draft cannot add, so it
    # plateaus near 0.3 (it learns <eos> and the likely leading digits).
    assert losses[-1] < losses[0]
    assert after > before + 0.1, (before, after)


def test_distiller_refuses_samples_it_cannot_train_on(policy) -> None:
    model, _ = policy
    distiller = DraftDistiller(build_draft(model, layers=1))
    with pytest.raises(DistillInputError, match="one per completion token"):
        distiller.step([PolicySample([1, 5], [6, 7], loss_mask=[1])])
    with pytest.raises(DistillInputError, match="every loss_mask entry is 0"):
        distiller.step([PolicySample([1, 5], [6, 7], loss_mask=[0, 0])])
    with pytest.raises(DistillInputError, match="vocabulary"):
        distiller.step([PolicySample([1, 5], [10_000])])
    with pytest.raises(DistillInputError, match="temperature"):
        DraftDistiller(build_draft(model, layers=1), temperature=0.0)
    # Masked-out tokens (an environment's) carry no loss: two samples that differ only there
    # give the same step (they come after the trained token, so they are not its context either).
    a, b = build_draft(model, layers=1), build_draft(model, layers=1)
    DraftDistiller(a).step([PolicySample([1, 5], [6, 7, 8], loss_mask=[1, 0, 0])])
    DraftDistiller(b).step([PolicySample([1, 5], [6, 20, 30], loss_mask=[1, 0, 0])])
    moved = [k for k, v in a.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    assert moved and all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_each_source_of_a_combined_drafter_has_its_own_draft_length(policy) -> None:
    """With "model+group" each source is measured on its own rows: a draft model equal to the policy
    keeps ~every token, the group's suffix matches far fewer, and neither estimate mixes in the
    other's.  A draft model that stops paying is switched off alone: the group keeps drafting (one
    shared rule had switched both off after a policy shift, README)."""
    model, tok = policy
    spec = _model_spec(build_draft(model, layers=model.config.num_hidden_layers), tail_rows=4, drafter="model+group")
    assert set(spec.lengths) == {"group", "model"} and spec.lengths["group"] is not spec.lengths["model"]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10)
    prompts = [encode_prompt(tok, t) for t in PROMPTS[:2]]
    sampler, gen, total = GroupSampler(StaticSlot(model), speculation=spec), torch.Generator().manual_seed(6), TailStats()
    for _ in range(4):
        sampler.sample_groups(prompts, 2, params, generator=gen)
        total.add(spec.last_call)
    assert total.model_drafted > 0 and total.group_drafted > 0, total
    assert total.model_kept / total.model_drafted > 0.99 > total.group_kept / total.group_drafted, total
    assert spec.lengths["model"].alpha > spec.lengths["group"].alpha
    assert spec.lengths["group"].draft_cost < spec.lengths["model"].draft_cost

    for _ in range(60):
        spec.lengths["model"].observe(kept=0, trials=4)  # the draft model's acceptance collapses
    assert spec.lengths["model"].k(2) == 0 and spec.lengths["group"].k(2) > 0
    assert spec.wants_tail(2)
    later = TailStats()
    for _ in range(3):
        sampler.sample_groups(prompts, 2, params, generator=gen)
        later.add(spec.last_call)
    assert later.group_drafted > 0 and later.model_drafted == 0, later


def test_a_draft_equal_to_the_policy_has_every_draft_kept(policy) -> None:
    """With q = p the rule keeps every drafted token (min(1, p/q) = 1): this holds only when the
    drafter hands over the distributions it sampled from, aligned with its tokens (as point masses
    the keep rate would be p(x), about 0.5 here)."""
    model, tok = policy
    spec = _model_spec(build_draft(model, layers=model.config.num_hidden_layers), tail_rows=2, fixed=True)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)
    prompts = [encode_prompt(tok, t) for t in PROMPTS]
    sampler, gen, total = GroupSampler(StaticSlot(model), speculation=spec), torch.Generator().manual_seed(4), TailStats()
    for p in prompts:
        sampler.sample_groups([p], 2, params, generator=gen)
        total.add(spec.last_call)
    assert total.drafted >= 24 and total.kept / total.drafted > 0.99, total


def test_draft_length_counts_the_drafting_cost() -> None:
    from rlbus.services.policy.spec_tail import DraftLength

    free, costly = DraftLength(max_k=4), DraftLength(max_k=4)
    for length, draft_s in ((free, 0.0001), (costly, 0.01)):
        for _ in range(40):
            length.observe(kept=3, trials=4)  # alpha 0.75: pays when drafting is free
            # 4 tokens drafted per row at 1 row in 10 ms vs a 5 ms verify forward (~4 ms a step):
            # ~0.6 steps per drafted token, as a draft model of half the policy's depth.
            length.observe_cost(draft_s, 0.005, k=4, rows=1)
    assert free.k(1) == 4 and free.draft_cost < 0.01
    assert costly.k(1) == 0 and 0.5 < costly.draft_cost < 0.7
    for _ in range(100):
        costly.observe(kept=0, trials=0)  # switched off: no rounds, the cost decays to its prior
    assert costly.k(1) > 0
