"""Exact speculative sampling preserves the target distribution; greedy matching does not.

A toy bigram "language model" over 6 tokens plays the target (its logits go through the real
`processed_logprobs`, so temperature and top-p truncation are the trainer's) and a second bigram
table or a deterministic rule plays the drafter. 200k rows are sampled two tokens deep through
the speculative loop and the empirical joint distribution of (first, second) token is compared
with p(t1) p(t2 | t1) by a chi-square test. Each test has a fixed seed, so it is deterministic;
the threshold p-value 1e-3 is the false-alarm rate the test would have over random seeds.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rlbus.services.policy.draft_round import RoundDrafts
from rlbus.services.policy.model_drafter import ModelDrafts
from rlbus.services.policy.sampling import processed_logprobs
from rlbus.services.policy.speculative import SpeculativeInputError, Verified, accept_drafts

V = 6
BOS = V  # row V of the tables is the context "start of sequence"
ROWS = 200_000
K = 2
P_VALUE_FLOOR = 1e-3

TARGET_LOGITS = torch.tensor([
    [2.0, 1.0, 0.5, 0.0, -1.0, -2.0],
    [0.0, 2.5, 0.2, 1.0, -0.5, 0.3],
    [1.0, 1.0, 1.0, 0.0, 0.0, -3.0],
    [-1.0, 0.0, 3.0, 0.5, 0.5, 0.0],
    [0.3, -0.2, 0.1, 2.0, 1.5, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 2.0],
    [1.5, 0.5, 2.0, -1.0, 0.0, 0.0],  # after BOS
])
# The drafter's own bigram: it puts no mass on some tokens the target likes (support gaps) and
# mass on tokens top-p removes from the target.
DRAFT_PROBS = torch.tensor([
    [0.0, 0.5, 0.0, 0.0, 0.0, 0.5],
    [0.2, 0.2, 0.2, 0.2, 0.2, 0.0],
    [0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
    [0.1, 0.0, 0.0, 0.0, 0.0, 0.9],
    [0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.3, 0.3, 0.4],
    [0.0, 0.0, 0.2, 0.0, 0.0, 0.8],
])


# A deterministic drafter (a point mass): what it proposes after each context. Some proposals
# are the target's argmax, some are inside its nucleus, some (2 -> 5) outside it.
POINT_DRAFTS = torch.tensor([1, 1, 5, 2, 0, 5, 2])


Verify = Callable[..., Verified]


def _round(prev: torch.Tensor, table: torch.Tensor, drafter: str, verify: Verify,
           gen: torch.Generator) -> Verified:
    """Draft K tokens after `prev` for every row and verify them against the target table."""
    drafts, qs = [], []
    ctx = prev
    for _ in range(K):
        if drafter == "point":
            x = POINT_DRAFTS[ctx]
        else:
            qs.append(DRAFT_PROBS[ctx])
            x = torch.multinomial(qs[-1], 1, generator=gen).squeeze(-1)
        drafts.append(x)
        ctx = x
    draft_ids = torch.stack(drafts, dim=1)
    target = table[torch.cat([prev[:, None], draft_ids], dim=1)]  # [rows, K+1, V]
    q = torch.stack(qs, dim=1) if qs else None
    return verify(target, draft_ids, torch.full((len(prev),), K), gen, draft_probs=q)


def _two_tokens(table: torch.Tensor, drafter: str, verify: Verify, seed: int) -> torch.Tensor:
    """[ROWS, 2] first and second tokens of each row through the speculative loop."""
    gen = torch.Generator().manual_seed(seed)
    first = _round(torch.full((ROWS,), BOS), table, drafter, verify, gen)
    t1 = first.tokens[:, 0]
    t2 = first.tokens[:, 1].clone()
    short = first.emitted < 2  # these rows emitted one token: a second round gives their next
    second = _round(t1[short], table, drafter, verify, gen)
    t2[short] = second.tokens[:, 0]
    return torch.stack([t1, t2], dim=1)


def _chi_square_p(samples: torch.Tensor, table: torch.Tensor) -> float:
    """p-value of the joint (t1, t2) counts against p(t1 | BOS) p(t2 | t1); cells the target
    gives no mass must be empty (top-p truncation is exact, not approximately so)."""
    p = table.exp()
    expected = (p[BOS][:, None] * p[:V]) * ROWS
    counts = torch.zeros(V, V)
    counts.index_put_((samples[:, 0], samples[:, 1]), torch.ones(len(samples)), accumulate=True)
    impossible = expected == 0
    assert counts[impossible].sum() == 0, "a token outside the target's nucleus was emitted"
    cells = expected[~impossible]
    stat = ((counts[~impossible] - cells) ** 2 / cells).sum()
    df = torch.tensor(float(cells.numel() - 1))
    return float(torch.special.gammaincc(df / 2, stat.double() / 2))


def _greedy_matching(target, draft_ids, draft_lens, gen, *, draft_probs=None) -> Verified:
    """The naive rule: keep drafts while they equal the target's argmax, then sample from p."""
    k = draft_ids.shape[1]
    keep = (draft_ids == target[:, :k].argmax(-1)).long().cumprod(-1)
    return _finish(target, draft_ids, keep.sum(-1), gen)


def _no_residual(target, draft_ids, draft_lens, gen, *, draft_probs=None) -> Verified:
    """Right acceptance test, but the replacement after a rejection drawn from p, not the residual."""
    k = draft_ids.shape[1]
    p = target[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1).exp()
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    keep = (torch.rand(p.shape, generator=gen) * q < p).long().cumprod(-1)
    return _finish(target, draft_ids, keep.sum(-1), gen)


def _finish(target, draft_ids, accepted, gen) -> Verified:
    rows, k = draft_ids.shape
    p_next = target.gather(1, accepted[:, None, None].expand(-1, 1, V)).squeeze(1).exp()
    final = torch.multinomial(p_next, 1, generator=gen).squeeze(-1)
    tokens = torch.zeros((rows, k + 1), dtype=torch.long)
    tokens[:, :k] = draft_ids
    tokens.scatter_(1, accepted[:, None], final[:, None])
    return Verified(tokens=tokens, logprobs=torch.zeros(rows, k + 1), accepted=accepted, emitted=accepted + 1)


SETTINGS = [(1.0, 1.0), (0.7, 0.8), (1.3, 0.6)]


@pytest.mark.parametrize("drafter", ["point", "sampled"])
@pytest.mark.parametrize(("temperature", "top_p"), SETTINGS)
def test_speculative_sampling_preserves_the_target_distribution(drafter: str, temperature: float, top_p: float) -> None:
    table = processed_logprobs(TARGET_LOGITS, temperature, top_p)
    samples = _two_tokens(table, drafter, accept_drafts, seed=11)
    assert _chi_square_p(samples, table) > P_VALUE_FLOOR


@pytest.mark.parametrize("rule", [_greedy_matching, _no_residual], ids=["greedy_matching", "no_residual"])
@pytest.mark.parametrize("drafter", ["point", "sampled"])
def test_naive_rules_fail_the_same_check(rule: Verify, drafter: str) -> None:
    """The check above has power: rules that are known to bias the output are rejected by it."""
    table = processed_logprobs(TARGET_LOGITS, 0.7, 0.8)
    samples = _two_tokens(table, drafter, rule, seed=11)
    assert _chi_square_p(samples, table) < 1e-9


def test_behaviour_logprobs_are_the_targets_and_drafts_stop_at_the_first_rejection() -> None:
    table = processed_logprobs(TARGET_LOGITS, 0.7, 0.8)
    gen = torch.Generator().manual_seed(3)
    prev = torch.full((5000,), BOS)
    out = _round(prev, table, "sampled", accept_drafts, gen)
    drafts_and_bos = torch.cat([prev[:, None], out.tokens[:, :K]], dim=1)
    for r in range(200):
        n = int(out.emitted[r])
        assert n == int(out.accepted[r]) + 1
        ctx = drafts_and_bos[r, :n]
        expected = table[ctx, out.tokens[r, :n]]
        assert torch.equal(out.logprobs[r, :n], expected)
        assert torch.isfinite(out.logprobs[r, :n]).all()
    # Rows that drafted fewer tokens never keep more than they drafted.
    lens = torch.randint(0, K + 1, (len(prev),), generator=gen)
    draft_ids = out.tokens[:, :K]
    short = accept_drafts(table[torch.cat([prev[:, None], draft_ids], 1)], draft_ids, lens, gen)
    assert bool((short.accepted <= lens).all())


def test_greedy_keeps_drafts_while_they_equal_the_argmax_and_draws_no_randomness() -> None:
    table = processed_logprobs(TARGET_LOGITS, 0.0, 1.0)
    argmax = TARGET_LOGITS.argmax(-1)
    right = argmax[BOS]
    draft_ids = torch.tensor([[right, argmax[right]], [right, (argmax[right] + 1) % V], [(right + 1) % V, 0]])
    target = table[torch.cat([torch.full((3, 1), BOS), draft_ids], 1)]
    gen = torch.Generator().manual_seed(0)
    before = gen.get_state()
    out = accept_drafts(target, draft_ids, torch.full((3,), K), gen, greedy=True)
    assert torch.equal(gen.get_state(), before)
    assert out.accepted.tolist() == [2, 1, 0]
    assert out.rows()[0][0] == [right, argmax[right], argmax[argmax[right]]]
    assert out.rows()[1][0] == [right, argmax[right]]
    assert out.rows()[2][0] == [right]
    assert all((lp == 0).all() for _, lp in out.rows())  # log 1: greedy is a point mass


def test_mismatched_shapes_are_refused_with_what_to_pass() -> None:
    target = torch.zeros(2, K + 1, V)
    with pytest.raises(SpeculativeInputError, match="needs \\[2, 2\\]"):
        accept_drafts(target, torch.zeros(2, K + 1, dtype=torch.long), torch.full((2,), K), torch.Generator())
    with pytest.raises(SpeculativeInputError, match="draft_lens"):
        accept_drafts(target, torch.zeros(2, K, dtype=torch.long), torch.full((2,), K + 1), torch.Generator())


@pytest.mark.parametrize(("temperature", "top_p"), SETTINGS)
def test_one_hot_draft_probs_are_the_point_mass_path(temperature: float, top_p: float) -> None:
    """A group proposal inside a mixed round (drafter "model+group") reaches the rule as a one-hot
    row of draft_probs: min(1, p/q) = p(x) and the residual is p without x, so with the same
    random draws the outcome is exactly the point-mass path's (draft_probs=None)."""
    table = processed_logprobs(TARGET_LOGITS, temperature, top_p)
    prev = torch.full((20_000,), BOS)
    draft_ids = torch.stack([POINT_DRAFTS[prev], POINT_DRAFTS[POINT_DRAFTS[prev]]], dim=1)
    lens = torch.randint(0, K + 1, (len(prev),), generator=torch.Generator().manual_seed(1))
    target = table[torch.cat([prev[:, None], draft_ids], 1)]
    one_hot = torch.zeros(len(prev), K, V).scatter_(-1, draft_ids[..., None], 1.0)
    point = accept_drafts(target, draft_ids, lens, torch.Generator().manual_seed(2))
    hot = accept_drafts(target, draft_ids, lens, torch.Generator().manual_seed(2), draft_probs=one_hot)
    assert 0 < int(point.accepted.sum()) < int(lens.sum())  # both kept and rejected drafts
    for a, b in ((point.tokens, hot.tokens), (point.accepted, hot.accepted), (point.logprobs, hot.logprobs)):
        assert torch.equal(a, b)


def test_a_mixed_round_preserves_the_target_distribution() -> None:
    """Half the rows drafted by the point drafter, half by the sampled one, in one verify round as
    `RoundDrafts.mixed` lays them out (the point rows one-hot): the chi-square above still holds."""
    table = processed_logprobs(TARGET_LOGITS, 0.7, 0.8)
    gen = torch.Generator().manual_seed(11)

    def mixed_round(prev: torch.Tensor) -> Verified:
        ids, qs, ctx = [], [], prev
        for _ in range(K):
            q = DRAFT_PROBS[ctx]
            sampled = torch.multinomial(q, 1, generator=gen).squeeze(-1)
            point = POINT_DRAFTS[ctx]
            x = point.clone()
            x[1::2] = sampled[1::2]
            ids.append(x)
            qs.append(q)
            ctx = x
        draft_ids = torch.stack(ids, 1)
        rows = list(range(1, len(prev), 2))
        group = [draft_ids[i].tolist() if i % 2 == 0 else [] for i in range(len(prev))]
        model = ModelDrafts([draft_ids[i].tolist() for i in rows], torch.stack(qs, 1)[rows])
        drafts = RoundDrafts.mixed(group, rows, model)
        assert drafts.sources[:2] == ["group", "model"] and drafts.probs is not None
        target = table[torch.cat([prev[:, None], draft_ids], 1)]
        return accept_drafts(target, draft_ids, torch.full((len(prev),), K), gen, draft_probs=drafts.probs)

    first = mixed_round(torch.full((ROWS,), BOS))
    t1, t2 = first.tokens[:, 0], first.tokens[:, 1].clone()
    short = (first.emitted < 2).nonzero().squeeze(-1)
    second = mixed_round(t1[short])
    t2[short] = second.tokens[:, 0]
    assert _chi_square_p(torch.stack([t1, t2], 1), table) > P_VALUE_FLOOR
