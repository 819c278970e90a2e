"""Does a fixed tensor shape give bit-identical logprobs in batches? And what does it cost?

For each model (the warm-started tiny policy, and an untrained wider Qwen2 built from config,
hidden 512 and a 512-token context, whose rows run past the ~128-token point where attention's
reduction order starts to depend on the padded length) and a few dozen random sequences of
mixed lengths, token logprobs are compared bit for bit (``torch.equal`` on float32):

- ``alone_vs_fixed``: the per-sequence path (each sequence alone, unpadded, eager) vs the
  fixed-shape batch (`rlbus.services.policy.exact.fixed_shape_logprobs`);
- ``neighbours``: the fixed-shape batch vs the same sequences shuffled among others (other
  neighbours, other rows);
- ``train_grad``: no_grad in eval mode vs train() mode with autograd (the trainer's forward);
- ``sdpa_vs_eager``: the two attention kernels, same shapes;
- ``other_batch_size`` / ``other_bucket``: the same rule with another batch size or bucket width;
- ``threads_1_vs_2``: the fixed-shape batch with 1 and with 2 torch threads (generator and
  trainer each have their own ``threads`` setting), and the per-sequence path likewise.

Each pair reports ``equal`` and ``max_abs_diff``.  Cost (one thread, median process-CPU seconds over
``--repeats``, same process): logprobs of the same sequences per sequence vs fixed-shape batched,
without grad (the generator's recompute) and forward+backward (the trainer), and the default
batched forward for reference; on the tiny policy also for the real workload (32 addition prompts
x 8 samples, as ``bench/deterministic_cost.py``), where the trainer's default is the shared-prefix
forward and the generator's slowdown is (sampling + recompute) / sampling.  Padding waste: computed token slots / real
tokens for several bucket rules.  Results: docs/measurements/batch-invariance-cpu2-2026-12-05.md.

    .venv/bin/python bench/batch_invariance.py --model models/tiny-addition
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

Seqs = list[tuple[list[int], list[int]]]


def _random_sequences(seed: int, count: int, min_len: int, max_len: int, vocab: int) -> Seqs:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(min_len, max_len)
        p = rng.randint(1, n - 1)
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        out.append((ids[:p], ids[p:]))
    return out


def _compare(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> dict[str, Any]:
    equal = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    diff = max(float((x - y).abs().nan_to_num(0.0).max()) if len(x) else 0.0 for x, y in zip(a, b, strict=True))
    return {"equal": equal, "max_abs_diff": diff}


def _wide_model(vocab: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, intermediate_size=1536, max_position_embeddings=512,
                      tie_word_embeddings=False, dtype="float32")
    return Qwen2ForCausalLM(cfg).eval()


def per_sequence(model: torch.nn.Module, seqs: Seqs, params: Any, *, grad: bool = False) -> list[torch.Tensor]:
    """Every sequence forwarded alone, unpadded, with eager attention (shapes that depend on nothing
    else by construction): the baseline the fixed shape is measured against."""
    from rlbus.services.policy.sampling import processed_logprobs
    from rlbus.services.policy.sequences import attention

    out = []
    with torch.set_grad_enabled(grad), attention(model, "eager"):
        for prompt, completion in seqs:
            ids = torch.tensor([[*prompt, *completion]], dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(completion) + 1).logits[0, :len(completion)]
            out.append(processed_logprobs(logits, params.temperature, params.top_p)
                       .gather(-1, ids[0, len(prompt):].unsqueeze(-1)).squeeze(-1))
    return out


def invariance(model: torch.nn.Module, seqs: Seqs, others: Seqs, shapes: Any, other_bucket: int) -> dict[str, Any]:
    from dataclasses import replace

    from rlbus.services.policy.exact import fixed_shape_logprobs
    from rlbus.services.policy.sampling import SamplingParams

    params = SamplingParams(temperature=1.0)

    def fixed(batch: Seqs, **kw: Any) -> list[torch.Tensor]:
        sh = kw.pop("shapes", shapes)
        return [t.detach() for t in fixed_shape_logprobs(model, batch, params, sh, **kw)]

    out: dict[str, Any] = {}
    for attn in ("sdpa", "eager"):
        base = fixed(seqs, attn=attn)
        mixed = [(s, i) for i, s in enumerate(seqs)] + [(s, None) for s in others]
        random.Random(5).shuffle(mixed)
        got = fixed([s for s, _ in mixed], attn=attn)
        shuffled = [torch.empty(0)] * len(seqs)
        for (_, i), lp in zip(mixed, got, strict=True):
            if i is not None:
                shuffled[i] = lp
        model.train()
        try:
            trained = fixed(seqs[::-1], attn=attn, grad=True)[::-1]
        finally:
            model.eval()
        torch.set_num_threads(2)
        two_threads = fixed(seqs, attn=attn)
        torch.set_num_threads(1)
        out[attn] = {
            "alone_vs_fixed": _compare(per_sequence(model, seqs, params), base),
            "neighbours": _compare(base, shuffled),
            "train_grad": _compare(base, trained),
            "other_batch_size": _compare(base, fixed(seqs, attn=attn, shapes=replace(shapes, batch_size=3))),
            "other_bucket": _compare(base, fixed(seqs, attn=attn, shapes=replace(shapes, bucket=other_bucket))),
            "threads_1_vs_2": _compare(base, two_threads),
        }
    out["sdpa_vs_eager"] = _compare(fixed(seqs, attn="sdpa"), fixed(seqs, attn="eager"))
    alone_1 = per_sequence(model, seqs, params)
    torch.set_num_threads(2)
    alone_2 = per_sequence(model, seqs, params)
    torch.set_num_threads(1)
    out["alone_threads_1_vs_2"] = _compare(alone_1, alone_2)
    return out


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median process-CPU seconds of ``fn``: with one torch thread that is the compute, and it
    is steadier than wall time on a shared machine."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def cost(model: torch.nn.Module, seqs: Seqs, variants: Sequence[Any], repeats: int,
         groups: list[tuple[list[int], list[list[int]]]] | None = None) -> dict[str, float]:
    """Median seconds per way of computing the logprobs of ``seqs``, and ratios.  ``groups``
    (the same sequences grouped by prompt) adds the trainer's default shared-prefix forward."""
    from rlbus.services.policy.exact import fixed_shape_logprobs
    from rlbus.services.policy.logprobs import completion_logprobs, shared_prefix_logprobs
    from rlbus.services.policy.sampling import SamplingParams

    params = SamplingParams(temperature=1.0)

    def backward(lps: list[torch.Tensor]) -> None:
        torch.cat(lps).sum().backward()
        model.zero_grad(set_to_none=True)

    runs: dict[str, Callable[[], object]] = {
        "infer_s/per_sequence": lambda: per_sequence(model, seqs, params),
        "infer_s/default": lambda: completion_logprobs(model, seqs, params),
        "fwd_bwd_s/per_sequence": lambda: backward(per_sequence(model, seqs, params, grad=True)),
        "fwd_bwd_s/default": lambda: backward(completion_logprobs(model, seqs, params, grad=True)),
    }
    if groups is not None:
        runs["fwd_bwd_s/default"] = lambda: backward(
            [x for g in shared_prefix_logprobs(model, groups, params, grad=True) for x in g])
    fixed_names = []
    for shapes in variants:
        for attn in ("sdpa", "eager"):
            name = f"fixed_{attn}_B{shapes.batch_size}_bucket{shapes.bucket}"
            fixed_names.append(name)
            runs[f"infer_s/{name}"] = (lambda sh=shapes, a=attn: fixed_shape_logprobs(model, seqs, params, sh, attn=a))
            runs[f"fwd_bwd_s/{name}"] = (lambda sh=shapes, a=attn: backward(
                fixed_shape_logprobs(model, seqs, params, sh, attn=a, grad=True)))
    out = {k: _median_s(fn, repeats) for k, fn in runs.items()}
    for kind in ("infer_s", "fwd_bwd_s"):
        for name in fixed_names:
            out[f"{kind}/{name}_over_default"] = out[f"{kind}/{name}"] / out[f"{kind}/default"]
            out[f"{kind}/per_sequence_over_{name}"] = out[f"{kind}/per_sequence"] / out[f"{kind}/{name}"]
    return out


def padding_waste(lengths: Sequence[int], max_len: int) -> dict[str, float]:
    """Computed token slots / real tokens, per bucket rule (fill rows included)."""
    from rlbus.services.policy.exact import FixedShapes

    real = sum(lengths)
    out = {}
    for batch_size in (4, 8, 16):
        for bucket in (8, 16, 32, 64):
            if bucket <= max_len:
                shapes = FixedShapes(batch_size=batch_size, bucket=bucket, max_len=max_len)
                out[f"B{batch_size}_bucket{bucket}"] = shapes.padded_tokens(lengths) / real
        # The default path: one batch padded to its longest sequence.
        slots = sum(batch_size * max(lengths[s: s + batch_size]) for s in range(0, len(lengths), batch_size))
        out[f"B{batch_size}_pad_to_batch_max"] = slots / real
    return out


def addition_workload(model: torch.nn.Module, tok: Any, repeats: int
                      ) -> tuple[Seqs, list[tuple[list[int], list[list[int]]]], float]:
    """32 addition prompts x 8 samples as the generator samples them: the sequences, the same
    grouped by prompt, and the median sampling seconds (what the recompute adds to)."""
    from rlbus.services.policy.sampler import GroupSampler, StaticSlot
    from rlbus.services.policy.sampling import SamplingParams
    from rlbus.services.tasks.addition import make_split

    prompts = [[tok.bos_token_id, *tok.encode(t.prompt, add_special_tokens=False)] for t in make_split("train", 32, 7)]
    sampler = GroupSampler(StaticSlot(model))
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    groups = sampler.sample_groups(prompts, 8, params, torch.Generator().manual_seed(0))
    sample_s = _median_s(lambda: sampler.sample_groups(prompts, 8, params, torch.Generator().manual_seed(0)), repeats)
    seqs = [(p, s.completion_ids) for p, g in zip(prompts, groups, strict=True) for s in g]
    return seqs, [(p, [s.completion_ids for s in g]) for p, g in zip(prompts, groups, strict=True)], sample_s


def _rounded(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    # Differences are ~1e-7: keep 3 significant digits rather than 4 decimals.
    return float(f"{v:.3g}") if isinstance(v, float) else v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-addition", help="the warm-started tiny policy folder")
    ap.add_argument("--sequences", type=int, default=32, help="random sequences per model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-wide", action="store_true", help="only the tiny policy")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from rlbus.services.policy.exact import FixedShapes
    from rlbus.services.policy.load import load_policy

    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(f"{args.model} is not a model folder: run `rlbus init-model --out {args.model}` or pass --model")
    tiny, tok = load_policy(args.model)
    report: dict[str, Any] = {"torch": torch.__version__, "threads": 1}
    models: list[tuple[str, torch.nn.Module, int, int]] = [("tiny", tiny, 16, 24)]
    if not args.skip_wide:
        models.append(("wide", _wide_model(2000), 64, 96))
    for name, model, bucket, other_bucket in models:
        ctx, vocab = model.config.max_position_embeddings, model.config.vocab_size
        shapes = FixedShapes(batch_size=8, bucket=bucket, max_len=ctx)
        seqs = _random_sequences(0, args.sequences, 4, ctx - 1, vocab)
        others = _random_sequences(1, args.sequences // 2, 4, ctx - 1, vocab)
        entry: dict[str, Any] = {"shapes": {"batch_size": 8, "bucket": bucket, "max_len": ctx},
                                 "invariance": invariance(model, seqs, others, shapes, other_bucket),
                                 "cost_random_mixed": cost(model, seqs, [shapes], args.repeats),
                                 "padding_waste_random_mixed": padding_waste([len(p) + len(c) for p, c in seqs], ctx)}
        if name == "tiny":
            work, groups, sample_s = addition_workload(model, tok, args.repeats)
            variants = [FixedShapes(batch_size=b, bucket=8, max_len=ctx) for b in (8, 32, 64)]
            c = cost(model, work, variants, args.repeats, groups)
            # Costed as a generator that samples as the default one, then recomputes every sample
            # (the exact-decoding generator recomputes none: bench/deterministic_cost.py).
            c["sample_s/default"] = sample_s
            for v in variants:
                for attn in ("sdpa", "eager"):
                    key = f"fixed_{attn}_B{v.batch_size}_bucket{v.bucket}"
                    c[f"generator_slowdown/{key}"] = (sample_s + c[f"infer_s/{key}"]) / sample_s
            c["generator_slowdown/per_sequence"] = (sample_s + c["infer_s/per_sequence"]) / sample_s
            entry["cost_addition_32x8"] = c
            entry["padding_waste_addition_32x8"] = padding_waste([len(p) + len(c) for p, c in work], ctx)
        report[name] = entry
    print(json.dumps(_rounded(report)))


if __name__ == "__main__":
    main()
