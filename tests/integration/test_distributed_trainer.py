"""The distributed trainer (torchrun, FSDP2 over gloo on CPU) makes the single-process update.

Two ranks train three batches of scored groups (the third has one sequence, so rank 1 has
nothing to train on); rank 0 also checkpoints and reloads through the distributed state views
and hands its weights over as the service does.  Between the second and third batch rank 0 is
handed a batch whose sequence on rank 1's slice has a token id outside the vocabulary (what the
intake judge would stop, let through): the step must refuse it on rank 0 with
``LogprobInputError`` before any rank starts it (a rank raising mid-step would leave the others
in a collective), change nothing, and the job must go on.  One process then runs ``train_step`` on the
same batches from the same initial weights, and they are compared (float32; the two differ
only in summation order: per-rank partial gradients then a sum, and the sharded clip norm):

- the clipped gradient of step 1 (AdamW's first moment / (1 - beta1), from the step-1
  checkpoint): atol 1e-7, rtol 1e-5 per element;
- the weights after step 1: atol 1e-6, rtol 1e-5 per element wherever |gradient| >= 100 x eps.
  AdamW's first step moves a weight by lr * g / (|g| + eps): where |g| is itself near eps
  (eps = 1e-8, about 0.5% of the elements here) the rounding of g is amplified up to lr / eps
  = 1e5 times, so no float32 implementation of the same maths agrees there to 1e-6;
- the weights after three steps: every element within 0.2 x lr, and >= 99.9% of elements
  within atol 1e-6 + rtol 1e-5;
- the optimiser state in rank 0's checkpoint, and the whole-batch metrics rank 0 reports.

The torchrun job is this file run as a script.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rlbus.schemas import Rollout, SamplingParams, ScoredGroup, ScoredRollout, Task, spans_from_versions
from rlbus.services.trainer.batch import Assembler
from rlbus.services.trainer.distributed import backend_for, rank_slices
from rlbus.services.trainer.objective import ObjectiveConfig, policy_loss
from rlbus.services.trainer.settings import TrainerSettings
from rlbus.services.trainer.step import PackedSeq, pack

REPO = Path(__file__).resolve().parents[2]
ATOL, RTOL = 1e-6, 1e-5
# Exercises every path of a step: a KL term (reference model on each rank), two sampling
# temperatures (separate forwards), several micro-batches per rank.
CFG = dict(lr=1e-3, objective={"kl_coef": 0.05}, micro_batch_seqs=4, distributed="gloo")
TRAINER_VERSION, MAX_STALENESS = 2, 1


def _build_model(out: Path) -> None:
    from transformers import Qwen2ForCausalLM

    from rlbus.services.policy.model_init import tiny_config
    from rlbus.services.policy.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_config(tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _group(gid: str, rng: np.random.Generator, rewards: list[float], versions: list[int],
           temperature: float) -> ScoredGroup:
    prompt = [1, *rng.integers(4, 60, size=int(rng.integers(4, 10))).tolist()]  # <bos> + characters
    scored = []
    for i, (reward, version) in enumerate(zip(rewards, versions, strict=True)):
        n = int(rng.integers(1, 8))
        # About the random-init policy's own logprob (uniform over ~70 ids), off by up to ±0.3:
        # importance weights around 1, some beyond the truncation cap.
        behaviour = (-math.log(70.0) + rng.normal(0.0, 0.3, size=n)).astype("<f4")
        rollout = Rollout(rollout_id=f"{gid}/{i}", task_id=gid, index=i,
                          token_ids=np.array(prompt + rng.integers(4, 60, size=n).tolist(), dtype="<i4"),
                          prompt_len=len(prompt), loss_mask=np.ones(n, dtype="|u1"), behaviour_logprobs=behaviour,
                          version_spans=spans_from_versions(np.full(n, version)), text="")
        scored.append(ScoredRollout(rollout=rollout, reward=reward))
    task = Task(run="dist", task_id=gid, pool="train", env="addition", prompt="1+2=", group_size=len(rewards))
    return ScoredGroup(task=task, scored=scored, sampling=SamplingParams(temperature=temperature))


def _batches() -> list[list[ScoredGroup]]:
    rng = np.random.default_rng(7)
    reward_sets = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 1.0, 0.0], [1.0, 1.0, 0.0, 0.2], [0.0, 0.0, 0.0, 1.0]]
    first = [_group(f"a{g}", rng, reward_sets[g % 4], [2, 1, 2, 2], 1.0 if g % 2 else 0.8) for g in range(6)]
    second = [_group(f"b{g}", rng, reward_sets[(g + 1) % 4], [2, 2, 1, 2], 1.0) for g in range(5)]
    # One fresh rollout and one too stale to train (its reward still makes the baseline):
    # a batch of a single sequence, so rank 1's slice is empty.
    third = [_group("c0", rng, [1.0, 0.0], [2, 0], 1.0)]
    return [first, second, third]


def _bad_batch() -> list[ScoredGroup]:
    """Two groups, the second with a completion token outside the vocabulary: by token count the
    bad sequence falls in rank 1's slice, so only a rank-0 check before the step can stop it."""
    rng = np.random.default_rng(11)
    good, bad = _group("x0", rng, [1.0, 0.0], [2, 2], 1.0), _group("x1", rng, [0.0, 1.0], [2, 2], 1.0)
    last = bad.scored[1]
    ids = np.concatenate([last.rollout.token_ids[:-1], np.array([10**6], "<i4")])
    last = dataclasses.replace(last, rollout=dataclasses.replace(last.rollout, token_ids=ids))
    return [good, dataclasses.replace(bad, scored=[bad.scored[0], last])]


def _pack(groups: list[ScoredGroup], cfg: TrainerSettings) -> list[PackedSeq]:
    asm = Assembler(batch_groups=len(groups), max_staleness=MAX_STALENESS)
    for g in groups:
        assert asm.offer(g, None, version=TRAINER_VERSION, consumed=set()).reason == "train"
    batch, _ = asm.take()
    return pack(batch, cfg)[0]


# ---- the torchrun job ------------------------------------------------------------------------


def _job(model_dir: Path, out: Path) -> None:
    """Every rank: shard the policy; rank 0 trains the batches and writes what it ends with."""
    from rlbus.services.policy.load import load_policy
    from rlbus.services.policy.logprobs import LogprobInputError
    from rlbus.services.policy.upload import weights_bytes
    from rlbus.services.trainer import checkpoint
    from rlbus.services.trainer.distributed import ShardedPolicy

    torch.set_num_threads(1)
    cfg = TrainerSettings(**CFG)
    model, _ = load_policy(model_dir)
    sharded = ShardedPolicy.join(model, cfg, copy.deepcopy(model).eval())
    if sharded.rank > 0:
        sharded.follow()
        return
    metrics = []
    for i, groups in enumerate(_batches()):
        metrics.append(sharded.train_step(_pack(groups, cfg)))
        if i == 0:  # a checkpoint round trip through the views, as a resumed trainer does
            checkpoint.save(out / "ckpt", sharded.model_view, sharded.optimizer_view,  # type: ignore[arg-type]
                            checkpoint.TrainerState(step=1), keep=2)
            checkpoint.load_latest(out / "ckpt", sharded.model_view, sharded.optimizer_view)  # type: ignore[arg-type]
        if i == 1:
            seqs = _pack(_bad_batch(), cfg)
            lo, hi = rank_slices([len(s.prompt) + len(s.completion) for s in seqs], 2)[1]
            assert any(10**6 in s.completion for s in seqs[lo:hi]), "the bad sequence must be rank 1's"
            try:
                sharded.train_step(seqs)
            except LogprobInputError as exc:
                (out / "refused.txt").write_text(str(exc))
    checkpoint.save(out / "ckpt", sharded.model_view, sharded.optimizer_view,  # type: ignore[arg-type]
                    checkpoint.TrainerState(step=3), keep=2)
    data, _metas = weights_bytes(sharded.model_view)  # type: ignore[arg-type]
    (out / "weights.safetensors").write_bytes(data)
    (out / "metrics.json").write_text(json.dumps(metrics))
    sharded.close()
    (out / "done").write_text("rank 0 finished\n")


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_make_the_single_process_update(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from rlbus.services.policy.load import load_policy
    from rlbus.services.trainer.step import make_optimizer, train_step

    model_dir, out = tmp_path / "model", tmp_path / "out"
    out.mkdir()
    _build_model(model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, str(model_dir), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    job_s = time.perf_counter() - t0
    assert proc.returncode == 0, (f"torchrun failed ({proc.returncode}; rank 0 finished: {(out / 'done').exists()}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    assert (out / "done").exists(), "rank 0 did not finish"
    # The bad batch was refused on rank 0, naming the token; the comparisons below (three good
    # steps, no more) show it changed no weight and no optimiser state.
    assert "outside the vocabulary" in (out / "refused.txt").read_text()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = TrainerSettings(**{**CFG, "distributed": "off"})
        model, _ = load_policy(model_dir)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = make_optimizer(model, cfg)
        reference_policy = load_policy(model_dir)[0]
        ref, after_first = [], {}
        for groups in _batches():
            ref.append(train_step(model, optimizer, _pack(groups, cfg), cfg, reference_policy))
            if not after_first:
                after_first = {"weights": {k: v.clone() for k, v in model.state_dict().items()},
                               "optimizer": copy.deepcopy(optimizer.state_dict())}
    finally:
        torch.set_num_threads(threads)

    # 1. The gradient: AdamW's first moment after step 1 is (1 - beta1) x the clipped gradient
    #    (clipping is active: grad norm ~3.5 > 1), so the checkpoint of step 1 holds it exactly.
    names = [n for n, _ in model.named_parameters()]
    first = after_first["optimizer"]["state"]
    saved_first = torch.load(out / "ckpt" / "step-00000001" / "optimizer.pt", weights_only=True)["state"]
    grad_diff = max(float((saved_first[i]["exp_avg"] - first[i]["exp_avg"]).abs().max()) / 0.1 for i in first)
    for i, name in enumerate(names):
        torch.testing.assert_close(saved_first[i]["exp_avg"] / 0.1, first[i]["exp_avg"] / 0.1, atol=1e-7, rtol=RTOL,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")

    # 2. The weights after step 1 and after step 3 (the hand-over bytes of rank 0).
    lr = CFG["lr"]
    dist_first = load_file(str(out / "ckpt" / "step-00000001" / "model.safetensors"))
    dist_final = load_file(str(out / "weights.safetensors"))
    single_final = model.state_dict()
    assert set(dist_final) == set(single_final) == set(dist_first)
    max_update = max(float((v - initial[k]).abs().max()) for k, v in single_final.items())
    assert max_update > lr, "the steps did not move the weights: the comparison would prove nothing"
    first_diff = 0.0
    for i, n in enumerate(names):
        # Only where AdamW's step is well conditioned (see the module docstring).
        conditioned = first[i]["exp_avg"].abs() / 0.1 >= 100 * 1e-8
        torch.testing.assert_close(dist_first[n][conditioned], after_first["weights"][n][conditioned], atol=ATOL,
                                   rtol=RTOL, msg=lambda m, n=n: f"{n} after step 1: {m}")
        if bool(conditioned.any()):
            first_diff = max(first_diff, float((dist_first[n] - after_first["weights"][n])[conditioned].abs().max()))
    diffs = torch.cat([(dist_final[k] - v).abs().flatten() for k, v in single_final.items()])
    tight = float((diffs <= ATOL + RTOL * torch.cat([v.abs().flatten() for v in single_final.values()])).float().mean())
    print(f"\n2 ranks vs 1 process: max |grad diff| (step 1) = {grad_diff:.3g}; weights after step 1 where "
          f"|g| >= 1e-6: max |diff| = {first_diff:.3g}; weights after 3 steps: "
          f"max |diff| = {float(diffs.max()):.3g} (max |update| {max_update:.3g}), {100 * tight:.3f}% of elements "
          f"within atol {ATOL:g} + rtol {RTOL:g}; torchrun job {job_s:.1f} s")
    assert float(diffs.max()) <= 0.2 * lr
    assert tight >= 0.999

    # 3. The optimiser state, saved by rank 0 in the single-process layout, is the same state.
    saved = torch.load(out / "ckpt" / "step-00000003" / "optimizer.pt", weights_only=True)
    mine = optimizer.state_dict()
    assert saved["param_groups"] == mine["param_groups"]
    for i, st in mine["state"].items():
        assert float(saved["state"][i]["step"]) == float(st["step"]) == 3.0
        torch.testing.assert_close(saved["state"][i]["exp_avg"], st["exp_avg"], atol=1e-6, rtol=1e-3)

    # 4. Whole-batch metrics on rank 0, not rank 0's share.
    dist_metrics = json.loads((out / "metrics.json").read_text())
    for d, s in zip(dist_metrics, ref, strict=True):
        assert d["train/tokens"] == s["train/tokens"] and d["mismatch_fresh/tokens"] == s["mismatch_fresh/tokens"]
        for key in ("loss/pg", "loss/kl", "train/grad_norm", "mismatch/k3_kl", "mismatch/abs_diff_mean",
                    "is/weight_mean", "is/truncated_frac", "clip/frac_low", "clip/frac_high", "staleness/mean"):
            assert d[key] == pytest.approx(s[key], rel=1e-4, abs=1e-7), key


def test_rank_slices_keep_sequences_whole_and_balance_tokens() -> None:
    lengths = [10, 10, 30, 10, 10, 10, 20]
    for world in (1, 2, 3, 4, 8, 10):
        slices = rank_slices(lengths, world)
        assert len(slices) == world
        assert [i for lo, hi in slices for i in range(lo, hi)] == list(range(len(lengths)))
    two = rank_slices(lengths, 2)
    assert two == [(0, 3), (3, 7)]  # 50 / 50 tokens
    assert rank_slices([5], 2) == [(0, 1), (1, 1)]  # a one-sequence batch: rank 1 idles
    assert rank_slices([], 2) == [(0, 0), (0, 0)]


@pytest.mark.parametrize("aggregation,correction", [("token_mean", "tis"), ("seq_mean", "seq_reject"),
                                                    ("token_mean", "mis")])
def test_per_rank_losses_with_whole_batch_counts_sum_to_the_batch_loss(aggregation: str, correction: str) -> None:
    """What the SUM gradient reduction relies on: no rescaling is needed when every rank
    normalises its slice by the whole batch's token and sequence counts."""
    g = torch.Generator().manual_seed(3)
    lengths = [3, 7, 1, 5, 4, 6]
    seq = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])
    logp = (-2.0 + 0.3 * torch.randn(len(seq), generator=g)).requires_grad_()
    behaviour = logp.detach() + 0.05 * torch.randn(len(seq), generator=g)
    adv = torch.randn(len(lengths), generator=g)[seq]
    mask = torch.rand(len(seq), generator=g) > 0.2
    cfg = ObjectiveConfig(aggregation=aggregation, correction=correction, seq_low=0.97, seq_high=1.03)  # type: ignore[arg-type]
    n_tok = int(mask.sum())
    n_seq = len({int(s) for s in seq[mask]})

    def loss_of(lo: int, hi: int, lp: torch.Tensor) -> torch.Tensor:
        sel = (seq >= lo) & (seq < hi)
        loss, _ = policy_loss(lp[sel], proximal_logp=lp[sel].detach(), behaviour_logp=behaviour[sel],
                              advantages=adv[sel], mask=mask[sel], seq_index=seq[sel] - lo, n_seqs=max(hi - lo, 1),
                              cfg=cfg, n_tokens_total=n_tok, n_seqs_total=n_seq)
        return loss

    whole = loss_of(0, len(lengths), logp)
    (grad_whole,) = torch.autograd.grad(whole, logp)
    parts = [loss_of(lo, hi, logp) for lo, hi in rank_slices(lengths, 2)]
    (grad_parts,) = torch.autograd.grad(sum(parts), logp)
    torch.testing.assert_close(sum(parts).detach(), whole.detach(), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(grad_parts, grad_whole, atol=1e-8, rtol=1e-6)


def test_distributed_setting_needs_torchrun_only_when_asked() -> None:
    torchrun = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert backend_for("auto", {}) is None
    assert backend_for("off", torchrun) is None
    assert backend_for("auto", torchrun) in ("gloo", "nccl")
    assert backend_for("gloo", torchrun) == "gloo"
    from rlbus.services.trainer.distributed import DistributedTrainerError

    with pytest.raises(DistributedTrainerError, match="torchrun"):
        backend_for("gloo", {})


if __name__ == "__main__":
    from rlbus.services.trainer.distributed import leave_job

    _job(Path(sys.argv[1]), Path(sys.argv[2]))
    leave_job(0)  # as `rlbus serve` ends a rank
