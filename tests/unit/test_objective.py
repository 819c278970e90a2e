"""The trainer's pure-math core: group advantages, mismatch metrics, the policy loss."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbus.services.trainer.advantages import group_advantages, zero_variance_groups
from rlbus.services.trainer.mismatch import MISMATCH_METRICS, mismatch_metrics
from rlbus.services.trainer.objective import (
    POLICY_LOSS_METRICS,
    Aggregation,
    Correction,
    ObjectiveConfig,
    policy_loss,
)

torch.set_num_threads(1)

CORRECTIONS: tuple[Correction, ...] = ("tis", "mis", "seq_reject", "none")


# ---------------------------------------------------------------------------------------
# advantages


def test_mean_baseline_with_std_normalisation_matches_hand_values() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    adv = group_advantages(rewards, eps=0.0)
    # Row 0: mean 0.5, population std 0.5. Row 1: mean 5, population std sqrt(5).
    s5 = math.sqrt(5.0)
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [-3 / s5, -1 / s5, 1 / s5, 3 / s5]])
    torch.testing.assert_close(adv, expected)
    # eps only guards the division; with a real spread it barely matters.
    torch.testing.assert_close(group_advantages(rewards), expected, atol=1e-5, rtol=1e-5)


def test_mean_baseline_without_std_is_reward_minus_group_mean() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    adv = group_advantages(rewards, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_leave_one_out_baseline_excludes_own_reward() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0]])
    adv = group_advantages(rewards, normalize_std=False, baseline="leave_one_out")
    # Row 1: others' means are 5/3, 7/3, 2, 2.
    expected = torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3], [3 - 5 / 3, 1 - 7 / 3, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_zero_variance_groups_are_detected_and_get_exactly_zero_advantage() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.1, 0.1, 0.1], [0.0, 0.0, 0.0]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True, True]
    for baseline in ("mean", "leave_one_out"):
        for normalize_std in (True, False):
            adv = group_advantages(rewards, baseline=baseline, normalize_std=normalize_std)
            assert torch.equal(adv[[0, 2, 3]], torch.zeros(3, 3)), (baseline, normalize_std)
            assert bool((adv[1] != 0).all())


def test_zero_variance_ignores_uncounted_members_and_needs_two_counted() -> None:
    rewards = torch.tensor([[1.0, 0.0, 1.0], [1.0, float("nan"), 0.0], [5.0, 0.0, 0.0]])
    counted = torch.tensor([[True, False, True], [True, False, True], [True, False, False]])
    assert zero_variance_groups(rewards, counted).tolist() == [True, False, True]


def test_verifier_error_is_neither_trained_nor_in_the_baseline() -> None:
    rewards = torch.tensor([[1.0, 0.0, float("nan"), 1.0]])
    valid = torch.tensor([[True, True, False, True]])
    adv = group_advantages(rewards, valid=valid, normalize_std=False)
    # Baseline is the mean of the three counted rewards: 2/3. The failed member gets 0.
    torch.testing.assert_close(adv, torch.tensor([[1 / 3, -2 / 3, 0.0, 1 / 3]]))


def test_stale_sample_counts_in_the_baseline_but_is_not_trained_on() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    valid = torch.tensor([[True, True, False, True]])
    everyone = torch.ones(1, 4, dtype=torch.bool)
    with_stale = group_advantages(rewards, valid=valid, baseline_mask=everyone, normalize_std=False)
    without = group_advantages(rewards, valid=valid, normalize_std=False)
    torch.testing.assert_close(with_stale, torch.tensor([[0.5, -0.5, 0.0, 0.5]]))
    torch.testing.assert_close(without, torch.tensor([[1 / 3, -2 / 3, 0.0, 1 / 3]]))
    loo = group_advantages(rewards, valid=valid, baseline_mask=everyone, normalize_std=False, baseline="leave_one_out")
    torch.testing.assert_close(loo, torch.tensor([[1 - 1 / 3, 0 - 2 / 3, 0.0, 1 - 1 / 3]]))


def test_advantage_masks_are_validated() -> None:
    rewards = torch.tensor([[1.0, 0.0]])
    with pytest.raises(ValueError, match="baseline_mask"):
        group_advantages(rewards, valid=torch.tensor([[True, True]]), baseline_mask=torch.tensor([[True, False]]))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="groups, samples_per_group"):
        group_advantages(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="baseline must be one of"):
        group_advantages(rewards, baseline="median")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# mismatch metrics


def test_mismatch_of_identical_logprobs_is_exactly_neutral() -> None:
    logp = -torch.rand(50, generator=torch.Generator().manual_seed(0)) * 5
    mask = torch.ones(50, dtype=torch.bool)
    mask[::7] = False
    seq_index = torch.arange(50) // 10
    m = mismatch_metrics(logp, logp.clone(), mask, seq_index, is_low=0.5, is_high=2.0)
    assert tuple(m) == MISMATCH_METRICS
    assert m == {
        "mismatch/abs_diff_mean": 0.0,
        "mismatch/abs_diff_max": 0.0,
        "mismatch/k3_kl": 0.0,
        "mismatch/ppl_ratio": 1.0,
        "mismatch/ess": 1.0,
        "mismatch/truncated_frac": 0.0,
        "mismatch/masked_frac": 0.0,
        "mismatch/seq_ess": 1.0,
    }


def test_mismatch_of_a_known_shift_matches_hand_computation() -> None:
    behaviour = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0, -4.0], dtype=torch.float64)
    shift = [0.1, -0.2, 0.3, 0.0, 9.0, -0.7]  # the 9.0 token is masked out
    trainer = behaviour + torch.tensor(shift, dtype=torch.float64)
    mask = torch.tensor([True, True, True, True, False, True])
    seq_index = torch.tensor([0, 0, 1, 1, 1, 7])  # labels need not be contiguous
    m = mismatch_metrics(trainer, behaviour, mask, seq_index, is_low=0.6, is_high=1.25)

    d = [0.1, -0.2, 0.3, 0.0, -0.7]
    w = [math.exp(x) for x in d]  # 1.105, 0.819, 1.350, 1.0, 0.497
    n = len(d)
    seq_w = [math.exp(0.1 - 0.2), math.exp(0.3 + 0.0), math.exp(-0.7)]
    expected = {
        "mismatch/abs_diff_mean": sum(abs(x) for x in d) / n,
        "mismatch/abs_diff_max": 0.7,
        "mismatch/k3_kl": sum(math.exp(x) - 1 - x for x in d) / n,
        "mismatch/ppl_ratio": math.exp(-sum(d) / n),
        "mismatch/ess": sum(w) ** 2 / (n * sum(x * x for x in w)),
        "mismatch/truncated_frac": 1 / 5,  # only 1.350 > 1.25
        "mismatch/masked_frac": 2 / 5,  # 1.350 above, 0.497 below
        "mismatch/seq_ess": sum(seq_w) ** 2 / (3 * sum(x * x for x in seq_w)),
    }
    assert m.keys() == expected.keys()
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    # Trainer finds the samples less likely on average here (mean shift -0.1): ppl up.
    assert m["mismatch/ppl_ratio"] > 1


def test_truncation_threshold_of_mismatch_can_differ_from_the_mask_band() -> None:
    behaviour = torch.zeros(4)
    trainer = torch.log(torch.tensor([1.0, 1.6, 2.5, 3.5]))
    mask = torch.ones(4, dtype=torch.bool)
    m = mismatch_metrics(
        trainer, behaviour, mask, torch.zeros(4, dtype=torch.long), is_low=0.5, is_high=3.0, is_cap=1.5
    )
    assert m["mismatch/truncated_frac"] == 0.75
    assert m["mismatch/masked_frac"] == 0.25


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(-40.0, 0.0),  # trainer logp
            st.floats(-40.0, 0.0),  # behaviour logp
            st.booleans(),  # masked in
            st.integers(0, 4),  # sequence
        ),
        min_size=1,
        max_size=40,
    ).filter(lambda rows: any(r[2] for r in rows)),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_mismatch_metrics_stay_in_range(rows: list[tuple[float, float, bool, int]], dtype: torch.dtype) -> None:
    trainer = torch.tensor([r[0] for r in rows], dtype=dtype)
    behaviour = torch.tensor([r[1] for r in rows], dtype=dtype)
    mask = torch.tensor([r[2] for r in rows])
    seq_index = torch.tensor([r[3] for r in rows])
    m = mismatch_metrics(trainer, behaviour, mask, seq_index, is_low=0.5, is_high=2.0)
    assert 0.0 < m["mismatch/ess"] <= 1.0
    assert 0.0 < m["mismatch/seq_ess"] <= 1.0
    assert m["mismatch/k3_kl"] >= 0.0
    assert m["mismatch/ppl_ratio"] > 0.0
    assert 0.0 <= m["mismatch/truncated_frac"] <= m["mismatch/masked_frac"] <= 1.0
    assert m["mismatch/abs_diff_mean"] <= m["mismatch/abs_diff_max"]


def test_mismatch_rejects_bad_input() -> None:
    x = torch.zeros(3)
    idx = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="at least one unmasked token"):
        mismatch_metrics(x, x, torch.zeros(3, dtype=torch.bool), idx, is_low=0.5, is_high=2.0)
    with pytest.raises(ValueError, match="NaN or infinite"):
        mismatch_metrics(
            torch.tensor([0.0, float("nan"), 0.0]), x, torch.ones(3, dtype=torch.bool), idx, is_low=0.5, is_high=2.0
        )
    with pytest.raises(ValueError, match="is_low"):
        mismatch_metrics(x, x, torch.ones(3, dtype=torch.bool), idx, is_low=1.5, is_high=2.0)
    # A NaN on a masked-out (padding) token is not measured and not an error.
    m = mismatch_metrics(
        torch.tensor([0.0, float("nan"), 0.0]), x, torch.tensor([True, False, True]), idx, is_low=0.5, is_high=2.0
    )
    assert m["mismatch/k3_kl"] == 0.0


# ---------------------------------------------------------------------------------------
# policy loss: single-token probes


def _grad(
    *,
    log_ratio: float = 0.0,
    log_w: float = 0.0,
    advantage: float = 1.0,
    cfg: ObjectiveConfig | None = None,
) -> tuple[float, dict[str, float]]:
    """d loss / d logp of one token with ratio exp(log_ratio) and IS weight exp(log_w)."""
    behaviour = torch.tensor([-1.0], dtype=torch.float64)
    proximal = behaviour + log_w
    logp = (proximal + log_ratio).requires_grad_()
    loss, metrics = policy_loss(
        logp,
        proximal_logp=proximal,
        behaviour_logp=behaviour,
        advantages=torch.tensor([advantage], dtype=torch.float64),
        mask=torch.tensor([True]),
        seq_index=torch.tensor([0]),
        n_seqs=1,
        cfg=cfg or ObjectiveConfig(correction="none"),
    )
    loss.backward()
    assert logp.grad is not None
    return float(logp.grad[0]), metrics


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_gradient_step_moves_logp_in_the_direction_of_the_advantage(advantage: float) -> None:
    g, _ = _grad(advantage=advantage)
    # At r = 1, d(-r A)/d logp = -A.
    assert g == pytest.approx(-advantage)
    logp_after = -1.0 - 0.1 * g
    assert (logp_after > -1.0) == (advantage > 0)


@pytest.mark.parametrize(
    ("advantage", "ratio", "gradient_flows", "clip_metric"),
    [
        # positive advantage: capped above 1 + clip_high, free below 1 - clip_low
        (1.0, 1.28 + 1e-3, False, "clip/frac_high"),
        (1.0, 1.28 - 1e-3, True, None),
        (1.0, 0.8 - 1e-3, True, None),
        # negative advantage: capped below 1 - clip_low, free above 1 + clip_high
        (-1.0, 0.8 - 1e-3, False, "clip/frac_low"),
        (-1.0, 0.8 + 1e-3, True, None),
        (-1.0, 1.28 + 1e-3, True, None),
    ],
)
def test_clip_removes_the_gradient_only_outside_the_trust_region_on_the_favoured_side(
    advantage: float, ratio: float, gradient_flows: bool, clip_metric: str | None
) -> None:
    g, m = _grad(log_ratio=math.log(ratio), advantage=advantage)
    if gradient_flows:
        # d(-r A)/d logp = -r A
        assert g == pytest.approx(-ratio * advantage)
    else:
        assert g == 0.0
    for key in ("clip/frac_low", "clip/frac_high"):
        assert m[key] == (1.0 if key == clip_metric else 0.0)


def test_tis_truncates_the_weight_at_is_cap() -> None:
    cfg = ObjectiveConfig(correction="tis", is_cap=2.0)
    g_big, m_big = _grad(log_w=math.log(5.0), cfg=cfg)
    g_small, m_small = _grad(log_w=math.log(1.5), cfg=cfg)
    assert g_big == pytest.approx(-2.0)
    assert m_big["is/truncated_frac"] == 1.0
    assert m_big["is/weight_mean"] == pytest.approx(2.0)
    assert g_small == pytest.approx(-1.5)
    assert m_small["is/truncated_frac"] == 0.0


def test_mis_zeroes_the_gradient_of_tokens_outside_the_band() -> None:
    behaviour = torch.full((4,), -1.0, dtype=torch.float64)
    w = torch.tensor([0.3, 0.7, 1.5, 3.0], dtype=torch.float64)
    proximal = behaviour + w.log()
    logp = proximal.clone().requires_grad_()
    loss, m = policy_loss(
        logp,
        proximal_logp=proximal,
        behaviour_logp=behaviour,
        advantages=torch.ones(4, dtype=torch.float64),
        mask=torch.ones(4, dtype=torch.bool),
        seq_index=torch.zeros(4, dtype=torch.long),
        n_seqs=1,
        cfg=ObjectiveConfig(correction="mis", is_low=0.5, is_high=2.0),
    )
    loss.backward()
    assert logp.grad is not None
    # Token-mean over 4 tokens: in-band tokens keep -w / 4; the others get exactly 0.
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.7 / 4, -1.5 / 4, 0.0], dtype=torch.float64))
    assert logp.grad[0] == 0.0 and logp.grad[3] == 0.0
    assert m["is/masked_frac"] == 0.5
    assert m["is/weight_mean"] == pytest.approx((0.7 + 1.5) / 4)


def test_seq_reject_drops_whole_sequences_by_geometric_mean_weight() -> None:
    # seq 0: token weights e^{+0.5}, e^{-0.5}: individually far off, geometric mean 1 -> kept.
    # seq 1: e^{0.1}, e^{0.1}: geometric mean 1.105 > seq_high -> dropped.
    # seq 2: exactly on-policy -> kept.
    # seq 3: ten tokens at e^{0.005}: product e^{0.05} is off, but the length-normalised
    #        geometric mean 1.005 is in band -> kept.
    log_w = torch.tensor([0.5, -0.5, 0.1, 0.1, 0.0] + [0.005] * 10, dtype=torch.float64)
    behaviour = torch.full((15,), -2.0, dtype=torch.float64)
    proximal = behaviour + log_w
    logp = proximal.clone().requires_grad_()
    loss, m = policy_loss(
        logp,
        proximal_logp=proximal,
        behaviour_logp=behaviour,
        advantages=torch.ones(15, dtype=torch.float64),
        mask=torch.ones(15, dtype=torch.bool),
        seq_index=torch.tensor([0, 0, 1, 1, 2] + [3] * 10),
        n_seqs=4,
        cfg=ObjectiveConfig(correction="seq_reject", seq_low=0.99, seq_high=1.01, is_cap=1.5),
    )
    loss.backward()
    assert logp.grad is not None
    # Surviving tokens are truncated at is_cap: e^{0.5} = 1.65 -> 1.5. Rejected ones get 0.
    expected = torch.tensor([-1.5, -math.exp(-0.5), 0.0, 0.0, -1.0] + [-math.exp(0.005)] * 10, dtype=torch.float64) / 15
    torch.testing.assert_close(logp.grad, expected)
    assert m["is/seq_rejected_frac"] == pytest.approx(1 / 4)
    assert m["is/masked_frac"] == pytest.approx(2 / 15)
    assert m["is/truncated_frac"] == pytest.approx(1 / 15)


# ---------------------------------------------------------------------------------------
# policy loss: batches


def _batch(seed: int, lengths: list[int], pad: int = 2, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Packed sequences, each followed by `pad` masked padding tokens holding garbage."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths) + pad * len(lengths)
    seq_index = torch.cat([torch.full((ln + pad,), s) for s, ln in enumerate(lengths)])
    mask = torch.cat([torch.tensor([True] * ln + [False] * pad) for ln in lengths])
    behaviour = -torch.rand(n, generator=gen, dtype=dtype) * 4
    proximal = behaviour + torch.randn(n, generator=gen, dtype=dtype) * 0.05
    logp = proximal + torch.randn(n, generator=gen, dtype=dtype) * 0.2
    seq_adv = torch.randn(len(lengths), generator=gen, dtype=dtype)
    ref = proximal + torch.randn(n, generator=gen, dtype=dtype) * 0.1
    garbage = ~mask
    return {
        "logp": torch.where(garbage, torch.tensor(float("nan"), dtype=dtype), logp),
        "proximal_logp": torch.where(garbage, torch.tensor(-float("inf"), dtype=dtype), proximal),
        "behaviour_logp": torch.where(garbage, torch.tensor(float("nan"), dtype=dtype), behaviour),
        "advantages": seq_adv[seq_index],
        "mask": mask,
        "seq_index": seq_index,
        "ref_logp": ref,
    }


def _loss_and_grad(
    b: dict[str, torch.Tensor], cfg: ObjectiveConfig, **kw: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    logp = b["logp"].clone().requires_grad_()
    loss, m = policy_loss(
        logp,
        proximal_logp=b["proximal_logp"],
        behaviour_logp=b["behaviour_logp"],
        advantages=b["advantages"],
        mask=b["mask"],
        seq_index=b["seq_index"],
        n_seqs=int(b["seq_index"].max()) + 1,
        cfg=cfg,
        ref_logp=b["ref_logp"],
        **kw,
    )
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), logp.grad, m


def test_on_policy_every_correction_is_a_bit_exact_no_op() -> None:
    b = _batch(seed=1, lengths=[5, 9, 3, 12])
    b["behaviour_logp"] = b["proximal_logp"].clone()  # deterministic mode: identical logprobs
    base_cfg = ObjectiveConfig(correction="none", kl_coef=0.05)
    loss0, grad0, m0 = _loss_and_grad(b, base_cfg)
    assert m0["clip/frac_low"] + m0["clip/frac_high"] > 0  # the probe really exercises clipping
    assert bool(torch.isfinite(grad0).all())
    for correction in CORRECTIONS:
        loss, grad, m = _loss_and_grad(b, dataclasses.replace(base_cfg, correction=correction))
        assert torch.equal(loss, loss0), correction
        assert torch.equal(grad, grad0), correction
        assert m["is/weight_mean"] == 1.0
        assert m["is/truncated_frac"] == m["is/masked_frac"] == m["is/seq_rejected_frac"] == 0.0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_micro_batch_accumulation_equals_the_full_batch(correction: Correction, aggregation: Aggregation) -> None:
    lengths = [5, 9, 3, 12, 1, 7]
    full = _batch(seed=2, lengths=lengths)
    # Make off-policy corrections bite: one sequence far off, spread elsewhere.
    full["behaviour_logp"] = full["behaviour_logp"] - 0.5 * (full["seq_index"] == 3)
    cfg = ObjectiveConfig(
        correction=correction,
        aggregation=aggregation,
        is_low=0.95,
        is_high=1.05,
        is_cap=1.02,
        seq_low=0.98,
        seq_high=1.02,
        kl_coef=0.1,
    )
    loss_full, grad_full, m_full = _loss_and_grad(full, cfg)

    n_tokens_total = int(full["mask"].sum())
    n_seqs_total = len(lengths)
    logp = full["logp"].clone().requires_grad_()
    total_loss = torch.zeros(())
    summed = dict.fromkeys(POLICY_LOSS_METRICS, 0.0)
    for seqs in ([0, 1], [2, 3, 4], [5]):
        rows = torch.isin(full["seq_index"], torch.tensor(seqs)).nonzero().squeeze(1)
        start, stop = int(rows[0]), int(rows[-1]) + 1
        local_index = full["seq_index"][start:stop] - seqs[0]
        loss, m = policy_loss(
            logp[start:stop],
            proximal_logp=full["proximal_logp"][start:stop],
            behaviour_logp=full["behaviour_logp"][start:stop],
            advantages=full["advantages"][start:stop],
            mask=full["mask"][start:stop],
            seq_index=local_index,
            n_seqs=len(seqs),
            cfg=cfg,
            ref_logp=full["ref_logp"][start:stop],
            n_tokens_total=n_tokens_total,
            n_seqs_total=n_seqs_total,
        )
        loss.backward()
        total_loss += loss.detach()
        for key, value in m.items():
            summed[key] += value

    assert logp.grad is not None
    torch.testing.assert_close(total_loss, loss_full, atol=1e-6, rtol=0)
    torch.testing.assert_close(logp.grad, grad_full, atol=1e-6, rtol=0)
    assert summed == pytest.approx(m_full, abs=1e-6)
    assert bool((grad_full[~full["mask"]] == 0).all())  # padding garbage never leaks
    if correction != "none":
        assert m_full["is/truncated_frac"] + m_full["is/masked_frac"] > 0  # corrections active


def test_token_mean_weighs_every_token_equally_and_seq_mean_every_sequence() -> None:
    # One long and one short sequence, same advantage: under token_mean each token's
    # gradient is -A / total_tokens; under seq_mean it is -A / (n_seqs * len(seq)).
    b = _batch(seed=3, lengths=[2, 6], pad=0, dtype=torch.float64)
    b["logp"] = b["proximal_logp"].clone()
    b["behaviour_logp"] = b["proximal_logp"].clone()
    b["advantages"] = torch.ones(8, dtype=torch.float64)
    _, g_tok, _ = _loss_and_grad(b, ObjectiveConfig(correction="none"))
    _, g_seq, _ = _loss_and_grad(b, ObjectiveConfig(correction="none", aggregation="seq_mean"))
    torch.testing.assert_close(g_tok, torch.full((8,), -1 / 8, dtype=torch.float64))
    torch.testing.assert_close(g_seq, torch.tensor([-1 / 4] * 2 + [-1 / 12] * 6, dtype=torch.float64))


def test_kl_penalty_pulls_the_policy_towards_the_reference() -> None:
    b = _batch(seed=4, lengths=[4], pad=0, dtype=torch.float64)
    b["advantages"] = torch.zeros(4, dtype=torch.float64)  # isolate the KL term
    b["ref_logp"] = b["logp"] + 0.3  # reference likes these tokens more
    loss, grad, m = _loss_and_grad(b, ObjectiveConfig(kl_coef=1.0))
    assert m["loss/pg"] == 0.0
    d = 0.3
    assert m["loss/kl"] == pytest.approx(math.exp(d) - 1 - d)
    assert loss.item() == pytest.approx(m["loss/kl"])
    assert bool((grad < 0).all())  # descending raises logp towards the reference
    # kl_coef = 0 still reports the KL but leaves the loss alone.
    loss0, _, m0 = _loss_and_grad(b, ObjectiveConfig(kl_coef=0.0))
    assert loss0.item() == 0.0 and m0["loss/kl"] == pytest.approx(m["loss/kl"])


def test_an_all_masked_micro_batch_contributes_nothing() -> None:
    b = _batch(seed=5, lengths=[3], pad=2)
    b["mask"] = torch.zeros_like(b["mask"])
    loss, grad, m = _loss_and_grad(b, ObjectiveConfig(), n_tokens_total=10, n_seqs_total=2)
    assert loss.item() == 0.0
    assert bool((grad == 0).all())
    assert all(v == 0.0 for v in m.values())


def test_policy_loss_rejects_bad_input() -> None:
    b = _batch(seed=6, lengths=[3], pad=0)
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(
            b["logp"],
            proximal_logp=b["proximal_logp"],
            behaviour_logp=b["behaviour_logp"],
            advantages=b["advantages"],
            mask=b["mask"],
            seq_index=b["seq_index"],
            n_seqs=1,
            cfg=ObjectiveConfig(kl_coef=0.1),
        )
    with pytest.raises(ValueError, match="seq_index of trained tokens"):
        policy_loss(
            b["logp"],
            proximal_logp=b["proximal_logp"],
            behaviour_logp=b["behaviour_logp"],
            advantages=b["advantages"],
            mask=b["mask"],
            seq_index=b["seq_index"] + 1,
            n_seqs=1,
            cfg=ObjectiveConfig(),
        )
    with pytest.raises(ValueError, match="advantages must have logp's shape"):
        policy_loss(
            b["logp"],
            proximal_logp=b["proximal_logp"],
            behaviour_logp=b["behaviour_logp"],
            advantages=b["advantages"][:2],
            mask=b["mask"],
            seq_index=b["seq_index"],
            n_seqs=1,
            cfg=ObjectiveConfig(),
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("clip_low", 1.0),
        ("clip_high", -0.1),
        ("correction", "ppo"),
        ("is_cap", 0.5),
        ("is_low", 1.5),
        ("is_high", 0.9),
        ("seq_low", 0.0),
        ("seq_high", 0.999),
        ("kl_coef", -1.0),
        ("aggregation", "sum"),
    ],
)
def test_config_rejects_values_that_would_break_the_objective(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ObjectiveConfig(**{field: value})  # type: ignore[arg-type]


def test_config_is_frozen_and_defaults_are_the_documented_ones() -> None:
    cfg = ObjectiveConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_low = 0.1  # type: ignore[misc]
    assert (cfg.clip_low, cfg.clip_high, cfg.correction, cfg.is_cap) == (0.2, 0.28, "tis", 2.0)
    assert (cfg.is_low, cfg.is_high, cfg.kl_coef, cfg.aggregation) == (0.5, 2.0, 0.0, "token_mean")
    assert [f.name for f in dataclasses.fields(ObjectiveConfig)] == [
        "clip_low",
        "clip_high",
        "correction",
        "is_cap",
        "is_low",
        "is_high",
        "seq_low",
        "seq_high",
        "kl_coef",
        "aggregation",
    ]


def test_the_exactness_claim_covers_fresh_labelled_tokens_and_counts_the_rest() -> None:
    from rlbus.services.policy.sampling import SamplingParams
    from rlbus.services.trainer.settings import TrainerSettings
    from rlbus.services.trainer.step import PackedSeq, step_metrics

    def seq(behaviour: list[float], *, staleness: int, exact: bool, mask: list[bool] | None = None) -> PackedSeq:
        return PackedSeq(prompt=[1], completion=[2] * len(behaviour), behaviour=torch.tensor(behaviour),
                         loss_mask=torch.tensor(mask or [True] * len(behaviour)), advantage=1.0,
                         staleness=staleness, sampling=SamplingParams(), exact=exact)

    seqs = [seq([-1.0, -2.0], staleness=0, exact=True),  # inside the claim, equal to the trainer's
            seq([-1.5, -1.0, -1.0], staleness=0, exact=False, mask=[True, False, True]),  # labelled inexact
            seq([-3.0], staleness=1, exact=True)]  # stale: another version's logprobs
    trainer = torch.tensor([-1.0, -2.0, -1.0, -9.0, -1.0, -2.0])
    m = step_metrics(seqs, {}, trainer, 1.0, TrainerSettings(), 0.0)
    assert m["mismatch_exact/tokens"] == 2 and m["mismatch_exact/excluded_tokens"] == 3  # 5 trained tokens
    assert m["mismatch_exact/abs_diff_max"] == 0.0
    assert m["mismatch/abs_diff_max"] == 1.0  # the stale token's gap is visible, outside the claim
    seqs[0] = seq([-1.0, -2.5], staleness=0, exact=True)
    assert step_metrics(seqs, {}, trainer, 1.0, TrainerSettings(), 0.0)["mismatch_exact/abs_diff_max"] == 0.5
