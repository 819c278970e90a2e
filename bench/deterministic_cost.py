"""Cost of deterministic mode: generator tokens/s and trainer step time, default vs
deterministic, same model, same prompts, same process (ratios are what to read).

    .venv/bin/python bench/deterministic_cost.py                       # the addition task: 4-6 token answers
    .venv/bin/python bench/deterministic_cost.py --completion-tokens 48  # every sample runs to 48 tokens

`--completion-tokens N` switches the model's end-of-sequence off, so each completion is exactly N
tokens: the shape of tasks with long answers.  The deterministic generator decodes in the
trainer's layout (`services/policy/exact_decode.py`); `generator_decoded_share` is the share of
samples whose log-probs came out of the decode itself rather than a recompute after it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rlbus.services.policy.exact import DETERMINISTIC_SHAPES
from rlbus.services.policy.exact_attention import EXACT_ATTN


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--completion-tokens", type=int, default=0, help="force every completion to this length (0: the task's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from rlbus.services.policy.load import load_policy
    from rlbus.services.policy.logprobs import completion_logprobs, shared_prefix_logprobs
    from rlbus.services.policy.sampler import GroupSampler, StaticSlot
    from rlbus.services.policy.sampling import SamplingParams
    from rlbus.services.tasks.addition import make_split

    model, tok = load_policy("models/tiny-addition")
    prompts = [[tok.bos_token_id, *tok.encode(t.prompt, add_special_tokens=False)] for t in make_split("train", 32, 7)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.completion_tokens or 6)
    if args.completion_tokens:
        model.generation_config.eos_token_id = None
        model.config.eos_token_id = None
    out: dict[str, float] = {}
    for mode in ("default", "deterministic"):
        sampler = GroupSampler(StaticSlot(model), deterministic=mode == "deterministic")
        times, tokens = [], 0
        for i in range(6):
            gen = torch.Generator().manual_seed(i)
            t0 = time.perf_counter()
            groups = sampler.sample_groups(prompts, 8, params, gen)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(s.completion_ids) for g in groups for s in g)
        sources = [s.logprobs_source for g in groups for s in g if s.completion_ids]
        out[f"generator_decoded_share/{mode}"] = sources.count("decoded") / len(sources)
        out[f"generator_tokens_per_s/{mode}"] = tokens / statistics.median(times[1:])
        seqs = [(p, s.completion_ids) for p, g in zip(prompts, groups, strict=True) for s in g]
        grouped = [(p, [s.completion_ids for s in g]) for p, g in zip(prompts, groups, strict=True)]
        step_times = []
        for _ in range(4):
            model.zero_grad()
            t0 = time.perf_counter()
            if mode == "deterministic":
                lps = completion_logprobs(model, seqs, params, deterministic=True, grad=True)
            else:
                lps = [x for g in shared_prefix_logprobs(model, grouped, params, grad=True) for x in g]
            torch.cat(lps).sum().backward()
            step_times.append(time.perf_counter() - t0)
        out[f"trainer_fwd_bwd_s/{mode}"] = statistics.median(step_times[1:])
    out.update(_padding(seqs))
    out["generator_slowdown"] = out["generator_tokens_per_s/default"] / out["generator_tokens_per_s/deterministic"]
    out["trainer_slowdown"] = out["trainer_fwd_bwd_s/deterministic"] / out["trainer_fwd_bwd_s/default"]
    print(json.dumps({**{k: round(v, 4) for k, v in out.items()}, "completion_tokens": args.completion_tokens or "task",
                      "shapes": repr(DETERMINISTIC_SHAPES), "attention": EXACT_ATTN}))


def _padding(seqs: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """Token slots the deterministic path computes per real token (pads and fill rows included),
    against the tokens a one-forward-per-sequence recompute would run (every prompt repeated)."""
    shapes = DETERMINISTIC_SHAPES
    prompts = list(dict.fromkeys(tuple(p) for p, _ in seqs))
    pairs = [(len(p), len(c)) for p, c in seqs if c]
    slots = shapes.padded_tokens([len(p) for p in prompts])
    slots += sum(shapes.rows(len(rows)) * width for (_, width), rows in shapes.plan_pairs(pairs))
    real = sum(len(p) for p in prompts) + sum(c for _, c in pairs)
    return {"det_slots_per_real_token": slots / real,
            "det_slots_vs_full_sequences": slots / sum(p + c for p, c in pairs)}


if __name__ == "__main__":
    main()
