"""Drafters compared in the real GroupSampler on long completions: none, a static draft model, a
distilled draft model, the group drafter, under a fixed policy (bench/speculative_drift.py shifts
it; results: docs/measurements/draft-model-cpu2-2026-12-06.md).

Workload: the tests' tiny addition policy with <eos> switched off (generation and model config),
so every completion runs `--max-new-tokens` (40; the context is 64). After its answer the policy
keeps emitting mostly <eos> ids with a scattered digit: a low-entropy continuation that a draft
can learn. Drafts (`--draft-layers` of the policy's 4, built by `build_draft` from its
embeddings, first layers, norm and head):
  static     the draft as built, frozen (the draft's first version);
  distilled  the same draft after `--distill-steps` DraftDistiller steps on the policy's samples
             of `--distill-prompts` train prompts x 8 (held-out prompts are benchmarked).
Shapes, each call one prompt:
  group8  8 rows decoded together, drafting across all of them (tail_rows 8): with <eos> off the
          rows end together, so this is the whole call, the "overall" figure of a group;
  tail1 / tail2  1 or 2 rows of a prompt, from their first token: the tail phase, the last rows
          of a group whose siblings finished (the group drafter has those siblings' completions,
          sampled beforehand, in its pool).
Modes per shape: off, static, distilled, group (adaptive draft length up to `--max-k`, which
counts the measured drafting cost), and static_fixed_k / distilled_fixed_k: the draft models at
k = max_k every round, what they would accept and cost without the adaptive switch-off.

Prints ONE JSON object: per shape and mode, medians over `--repeats` of wall and CPU ms per call
and tokens per wall second, speedups over `off`, and (drafting modes) acceptance rate, tokens per
row per target forward, seconds drafting vs verifying summed over the repeats. One torch thread.

  .venv/bin/python bench/speculative.py
  .venv/bin/python bench/speculative.py --draft-layers 2 --temperature 0.7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.speculative_accept import _model  # noqa: E402
from bench.speculative_tail import Shape, add_speedups, one_pass  # noqa: E402
from rlbus.services.policy.distill import DraftDistiller, PolicySample  # noqa: E402
from rlbus.services.policy.draft_model import build_draft  # noqa: E402
from rlbus.services.policy.sampler import GroupSampler, StaticSlot  # noqa: E402
from rlbus.services.policy.sampling import SamplingParams  # noqa: E402
from rlbus.services.policy.spec_tail import FixedDraftLength, Speculation, SpeculationConfig, TailStats  # noqa: E402
from rlbus.services.policy.tokenizer import encode_prompt  # noqa: E402
from rlbus.services.tasks.addition import make_split  # noqa: E402

SpecFactory = Callable[[int], Speculation | None]  # tail_rows -> a fresh tail (or None: off)


def distilled_draft(model: Any, tokenizer: Any, params: SamplingParams, args: argparse.Namespace) -> tuple[Any, dict]:
    """A draft distilled on the policy's samples of train prompts, and what that took."""
    draft = build_draft(model, layers=args.draft_layers)
    prompts = [encode_prompt(tokenizer, t.prompt) for t in make_split("train", args.distill_prompts, args.seed + 1)]
    t0 = time.perf_counter()
    with torch.no_grad():
        groups = GroupSampler(StaticSlot(model)).sample_groups(
            prompts, 8, params, generator=torch.Generator().manual_seed(args.seed + 1))
    samples = [PolicySample(p, s.completion_ids) for p, g in zip(prompts, groups, strict=True) for s in g]
    t1 = time.perf_counter()
    losses = DraftDistiller(draft, temperature=params.temperature).fit(samples, args.distill_steps, seed=args.seed)
    return draft, {"samples": len(samples), "steps": args.distill_steps, "sample_s": round(t1 - t0, 2),
                   "distill_s": round(time.perf_counter() - t1, 2), "loss_first": round(losses[0], 3),
                   "loss_last": round(losses[-1], 3)}


def compare(model: Any, shape: Shape, params: SamplingParams, modes: dict[str, SpecFactory], tail_rows: int,
            repeats: int) -> dict[str, Any]:
    per_mode: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    totals = {m: TailStats() for m in modes}
    specs = {m: make(tail_rows) for m, make in modes.items()}
    one_pass(model, Shape(shape.calls[:1], shape.rows), params, None, 999, TailStats())  # warm-up
    for rep in range(repeats):
        for m in modes:  # interleaved, so machine load drifts hit every mode alike
            walls, cpus, tokens = one_pass(model, shape, params, specs[m], rep, totals[m])
            per_mode[m].append((statistics.median(walls), statistics.median(cpus), tokens / sum(walls)))
    out: dict[str, Any] = {}
    for m, rows in per_mode.items():
        entry: dict[str, Any] = {"wall_ms_per_call": round(statistics.median(r[0] for r in rows) * 1e3, 2),
                                 "cpu_ms_per_call": round(statistics.median(r[1] for r in rows) * 1e3, 2),
                                 "tokens_per_s": round(statistics.median(r[2] for r in rows), 1)}
        if specs[m] is not None:
            t = totals[m]
            metrics = t.metrics()
            entry.update({"acceptance_rate": round(metrics["acceptance_rate"], 3),
                          "tokens_per_forward": round(metrics["tokens_per_forward"], 3),
                          "draft_s": round(t.draft_s, 3), "verify_s": round(t.verify_s, 3)})
        out[m] = entry
    add_speedups(out)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, tokenizer = _model(args.model)
    model.generation_config.eos_token_id = None  # long completions: <eos> is just another token
    model.config.eos_token_id = None
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    static = build_draft(model, layers=args.draft_layers)
    distilled, distill_info = distilled_draft(model, tokenizer, params, args)

    def model_spec(draft: Any, name: str, fixed: bool = False) -> SpecFactory:
        return lambda rows: Speculation(SpeculationConfig(drafter=name, tail_rows=rows, max_k=args.max_k),  # type: ignore[arg-type]
                                        draft=StaticSlot(draft), lengths=FixedDraftLength(args.max_k) if fixed else None)

    modes: dict[str, SpecFactory] = {
        "off": lambda rows: None, "static": model_spec(static, "static"), "distilled": model_spec(distilled, "model"),
        "group": lambda rows: Speculation(SpeculationConfig(drafter="group", tail_rows=rows, max_k=args.max_k))}
    if args.fixed_k:
        modes["static_fixed_k"] = model_spec(static, "static", fixed=True)
        modes["distilled_fixed_k"] = model_spec(distilled, "model", fixed=True)
    calls = [[encode_prompt(tokenizer, t.prompt)] for t in make_split("heldout", args.calls, args.seed)]
    with torch.no_grad():
        sampler, gen = GroupSampler(StaticSlot(model)), torch.Generator().manual_seed(args.seed)
        siblings = [[s.completion_ids for s in sampler.sample_groups(c, 8, params, generator=gen)[0]] for c in calls]
    report: dict[str, Any] = {"model": args.model or "tests tiny model", "eos": "off", "temperature": args.temperature,
                              "top_p": args.top_p, "max_new_tokens": args.max_new_tokens, "max_k": args.max_k,
                              "draft_layers": args.draft_layers, "policy_layers": model.config.num_hidden_layers,
                              "calls": args.calls, "repeats": args.repeats, "distill": distill_info, "shapes": {}}
    shapes = {"group8": (Shape(calls, 8), 8), "tail1": (Shape(calls, 1, [s[1:] for s in siblings]), 1),
              "tail2": (Shape(calls, 2, [s[2:] for s in siblings]), 2)}
    with torch.no_grad():
        for name, (shape, tail_rows) in shapes.items():
            report["shapes"][name] = compare(model, shape, params, modes, tail_rows, args.repeats)
    return report


def draft_options(parser: argparse.ArgumentParser) -> None:
    """The options `distilled_draft` and the drafting modes read, shared by the speculative benches."""
    parser.add_argument("--model", default=None, help="policy folder (default: the tests' tiny model)")
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--distill-prompts", type=int, default=64)
    parser.add_argument("--distill-steps", type=int, default=100)
    parser.add_argument("--max-k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    draft_options(parser)
    parser.add_argument("--calls", type=int, default=16, help="held-out prompts (one call each) per repeat")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fixed-k", action=argparse.BooleanOptionalAction, default=True,
                        help="also the draft models at k = max_k every round (what they could accept, at what cost)")
    print(json.dumps(run(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
