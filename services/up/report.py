"""report.png: reward, held-out accuracy, mismatch, throughput and staleness over time; with a
drafter on, a third row: acceptance and tokens per target forward, the draft's version lag, and
seconds drafting vs verifying."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlbus.schemas.metric_keys import DraftKeys, SpeculativeKeys, SpeculatorKeys
from rlbus.services.up.monitor import load_metrics


def write_report(metrics_path: Path, out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(metrics_path)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    if not train:
        return None
    t = [r["t"] for r in train]
    drafting = any(SpeculativeKeys.ACCEPTANCE_RATE in r for r in train)
    fig, ax = plt.subplots(3 if drafting else 2, 3, figsize=(15, 12 if drafting else 8))
    ax[0, 0].plot(t, [r.get("batch/reward_mean", 0) for r in train], label="batch reward (trained groups)")
    ax[0, 0].set_title("reward")
    ax[0, 1].plot([r["t"] for r in evals], [r["heldout/accuracy"] for r in evals], "o-", color="C2")
    ax[0, 1].axhline(0.9, ls="--", color="grey", lw=0.8)
    ax[0, 1].set_title("held-out accuracy (pinned versions)")
    ax[0, 1].set_ylim(0, 1)
    _mismatch_panel(ax[0, 2], train)
    ax[1, 0].plot(t, [r.get("generator/tokens_per_s", 0) for r in train])
    ax[1, 0].set_title("generator tokens/s")
    ax[1, 1].plot(t, [r.get("staleness/mean", 0) for r in train], label="mean")
    ax[1, 1].plot(t, [r.get("staleness/max", 0) for r in train], label="max")
    ax[1, 1].set_title("staleness (versions)")
    ax[1, 1].legend()
    ax[1, 2].plot(t, [r.get("trainer/idle_fraction", 0) for r in train])
    ax[1, 2].set_title("trainer idle fraction (cumulative)")
    if drafting:
        _drafting_row(ax[2], t, train)
    for a in ax.flat:
        a.set_xlabel("seconds")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _mismatch_panel(ax: Any, train: list[dict[str, Any]]) -> None:
    """Two things apart: the numerical gap (tokens sampled by the very version being trained, so only
    kernels and precision differ: ~1e-12 in float32, 0 in deterministic mode) and the total over every
    trained token, which adds the policy lag of stale samples (what the importance correction is for).
    Plotted together under one title, the lag would read as the generator disagreeing with the trainer."""
    floor = 1e-16  # log axis: an exact zero is drawn at the floor
    fresh = [r for r in train if r.get("mismatch_fresh/tokens", 0) > 0]
    ax.semilogy([r["t"] for r in fresh], [max(r.get("mismatch_fresh/k3_kl", 0), floor) for r in fresh],
                color="C0", label="numerical gap: k3 KL, same-version tokens")
    ax.semilogy([r["t"] for r in fresh], [max(r.get("mismatch_fresh/abs_diff_mean", 0), floor) for r in fresh],
                color="C0", ls="--", label="numerical gap: mean |Δ logprob|")
    ax.semilogy([r["t"] for r in train], [max(r.get("mismatch/k3_kl", 0), floor) for r in train],
                color="C3", label="numerical gap + policy lag: k3 KL, all tokens")
    ax.set_title("behaviour vs trainer log-probs")
    ax.legend(fontsize=7)


def _drafting_row(ax: Any, t: list[float], train: list[dict[str, Any]]) -> None:
    ax[0].plot(t, [r.get(SpeculativeKeys.ACCEPTANCE_RATE, 0) for r in train], label="acceptance rate")
    ax[0].plot(t, [r.get(SpeculativeKeys.TOKENS_PER_FORWARD, 0) for r in train], label="tokens / target forward")
    ax[0].set_title("speculative tail (latest call)")
    ax[0].legend()
    ax[1].plot(t, [r.get(DraftKeys.VERSION_LAG, 0) for r in train], label="in the generators (stalest)")
    ax[1].plot(t, [r.get(SpeculatorKeys.POLICY_VERSION_LAG, 0) for r in train], label="speculator's newest")
    ax[1].set_title("draft version lag behind the policy (versions)")
    ax[1].legend()
    ax[2].plot(t, [r.get(SpeculativeKeys.DRAFT_S, 0) for r in train], label="drafting")
    ax[2].plot(t, [r.get(SpeculativeKeys.VERIFY_S, 0) for r in train], label="verifying")
    ax[2].set_title("seconds per tail (latest call)")
    ax[2].legend()
