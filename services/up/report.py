"""report.png: reward, held-out accuracy, mismatch, throughput and staleness over time."""

from __future__ import annotations

from pathlib import Path

from services.up.monitor import load_metrics


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
    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    ax[0, 0].plot(t, [r.get("batch/reward_mean", 0) for r in train], label="batch reward (trained groups)")
    ax[0, 0].set_title("reward")
    ax[0, 1].plot([r["t"] for r in evals], [r["heldout/accuracy"] for r in evals], "o-", color="C2")
    ax[0, 1].axhline(0.9, ls="--", color="grey", lw=0.8)
    ax[0, 1].set_title("held-out accuracy (pinned versions)")
    ax[0, 1].set_ylim(0, 1)
    ax[0, 2].semilogy(t, [max(r.get("mismatch/k3_kl", 0), 1e-12) for r in train], label="k3 KL")
    ax[0, 2].semilogy(t, [max(r.get("mismatch/abs_diff_mean", 0), 1e-12) for r in train], label="mean |Δ logprob|")
    ax[0, 2].set_title("training–inference mismatch")
    ax[0, 2].legend()
    ax[1, 0].plot(t, [r.get("generator/tokens_per_s", 0) for r in train])
    ax[1, 0].set_title("generator tokens/s")
    ax[1, 1].plot(t, [r.get("staleness/mean", 0) for r in train], label="mean")
    ax[1, 1].plot(t, [r.get("staleness/max", 0) for r in train], label="max")
    ax[1, 1].set_title("staleness (versions)")
    ax[1, 1].legend()
    ax[1, 2].plot(t, [r.get("trainer/idle_fraction", 0) for r in train])
    ax[1, 2].set_title("trainer idle fraction (cumulative)")
    for a in ax.flat:
        a.set_xlabel("seconds")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
