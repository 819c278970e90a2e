"""The speculative tail in the real GroupSampler (services/policy/spec_tail.py): drafter off vs
`group`, same prompts, same seeds, on the addition task's run shape (results:
docs/measurements/speculative-tail-cpu2-2026-12-05.md).

Workload: addition prompts (train split, fixed seed), groups of 8 (the default group_size),
sampled at batch 1 (one group per call) and at the default batch (`--batch-groups`, 32 groups
per call as [run] batch_groups / [generator] max_batch_groups). On the tiny addition policy a
group's rows end within a step of each other, so these two shapes show what drafting costs
where there is (almost) no tail. `tail1` / `tail2` time the tail case itself: 1 or 2 rows of a
prompt whose other group-mates finished (their completions are in the drafter's pool).
Each call gets its own seeded generator, the same for every mode; the speculative modes keep
their drafter's pool of recent completions and measured acceptance across calls, as a generator
does. Modes: `off`, and `group` at each `--tail-rows`.

Prints ONE JSON object: per batch shape and mode, the median over `--repeats` of wall and CPU
milliseconds per call and of tokens per wall second, and (speculative modes) acceptance rate,
mean accepted length, tokens per row-forward in the tail, the share of tokens the tail emitted,
and seconds drafting vs verifying, summed over all calls. One torch thread.

  .venv/bin/python bench/speculative_tail.py                 # the tests' tiny model
  .venv/bin/python bench/speculative_tail.py --temperature 0.7 --tail-rows 1,2,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.speculative_accept import _model  # noqa: E402
from rlbus.services.policy.sampler import GroupSampler, StaticSlot  # noqa: E402
from rlbus.services.policy.sampling import SamplingParams  # noqa: E402
from rlbus.services.policy.spec_tail import Speculation, SpeculationConfig, TailStats  # noqa: E402
from rlbus.services.policy.tokenizer import encode_prompt  # noqa: E402
from rlbus.services.tasks.addition import make_split  # noqa: E402


@dataclass
class Shape:
    """Calls of `rows` samples per prompt; `siblings[i]`: finished completions of call i's prompt
    that a speculative pass adds to its pool before the call (untimed), as when the rest of the
    group has finished and these rows are its tail."""

    calls: list[list[list[int]]]
    rows: int
    siblings: list[list[list[int]]] | None = None


def one_pass(model: Any, shape: Shape, params: SamplingParams, spec: Speculation | None,
             seed: int, totals: TailStats) -> tuple[list[float], list[float], int]:
    """Every call once: (wall s per call, CPU s per call, tokens)."""
    sampler = GroupSampler(StaticSlot(model), speculation=spec)
    walls, cpus, tokens = [], [], 0
    for i, prompts in enumerate(shape.calls):
        if spec is not None and shape.siblings is not None:
            for c in shape.siblings[i]:
                spec.recent.add(c)
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        t0, c0 = time.perf_counter(), time.process_time()
        groups = sampler.sample_groups(prompts, shape.rows, params, generator=gen)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        tokens += sum(len(s.completion_ids) for g in groups for s in g)
        if spec is not None:
            totals.add(spec.last_call)
    return walls, cpus, tokens


def compare(model: Any, shape: Shape, params: SamplingParams, args: argparse.Namespace) -> dict[str, Any]:
    modes: dict[str, SpeculationConfig | None] = {"off": None}
    for rows in args.tail_rows:
        modes[f"group_tail{rows}"] = SpeculationConfig(drafter="group", tail_rows=rows, max_k=args.max_k)
    out: dict[str, Any] = {}
    per_mode: dict[str, list[tuple[float, float, float, int]]] = {m: [] for m in modes}
    totals = {m: TailStats() for m in modes}
    specs = {m: Speculation(c) if c is not None else None for m, c in modes.items()}
    one_pass(model, Shape(shape.calls[:1], shape.rows), params, None, 999, TailStats())  # warm-up
    for rep in range(args.repeats):
        for m in modes:  # interleaved, so machine load drifts hit every mode alike
            walls, cpus, tokens = one_pass(model, shape, params, specs[m], rep, totals[m])
            per_mode[m].append((statistics.median(walls), statistics.median(cpus), tokens / sum(walls), tokens))
    for m in modes:
        rows = per_mode[m]
        entry: dict[str, Any] = {
            "wall_ms_per_call": round(statistics.median(r[0] for r in rows) * 1e3, 2),
            "cpu_ms_per_call": round(statistics.median(r[1] for r in rows) * 1e3, 2),
            "tokens_per_s": round(statistics.median(r[2] for r in rows), 1),
        }
        if modes[m] is not None:
            t = totals[m]
            entry.update({k: round(v, 4) for k, v in t.metrics().items() if k not in ("k", "tail_tokens")})
            entry["tail_token_share"] = round(t.tokens / max(1, sum(r[3] for r in rows)), 4)
        out[m] = entry
    add_speedups(out)
    return out


def add_speedups(out: dict[str, Any]) -> None:
    """Each mode's wall and CPU speedup over ``out["off"]`` (ms per call), in place."""
    base = out["off"]
    for m, entry in out.items():
        if m != "off":
            entry["wall_speedup"] = round(base["wall_ms_per_call"] / entry["wall_ms_per_call"], 3)
            entry["cpu_speedup"] = round(base["cpu_ms_per_call"] / entry["cpu_ms_per_call"], 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, tokenizer = _model(args.model)
    tasks = make_split("train", max(args.calls, args.default_calls * args.batch_groups), seed=args.seed)
    prompts = [encode_prompt(tokenizer, t.prompt) for t in tasks]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    report: dict[str, Any] = {"model": args.model or "tests tiny model", "group_size": 8, "temperature": args.temperature,
                              "top_p": args.top_p, "max_new_tokens": args.max_new_tokens, "max_k": args.max_k,
                              "repeats": args.repeats, "shapes": {}}
    batch1 = [[p] for p in prompts[: args.calls]]
    shapes = {"batch1": Shape(batch1, 8),
              f"batch{args.batch_groups}": Shape([prompts[i * args.batch_groups:(i + 1) * args.batch_groups]
                                                  for i in range(args.default_calls)], 8)}
    with torch.no_grad():
        if args.tail_shapes:
            # The tail case itself: 1 or 2 rows of a prompt whose other group-mates finished.
            sampler, gen = GroupSampler(StaticSlot(model)), torch.Generator().manual_seed(args.seed)
            siblings = [[s.completion_ids for s in sampler.sample_groups(c, 8, params, generator=gen)[0]] for c in batch1]
            for rows in (1, 2):
                shapes[f"tail{rows}"] = Shape(batch1, rows, [s[rows:] for s in siblings])
        for name, shape in shapes.items():
            report["shapes"][name] = {"calls": len(shape.calls), "rows_per_prompt": shape.rows,
                                      **compare(model, shape, params, args)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="policy folder (default: the tests' tiny model)")
    parser.add_argument("--calls", type=int, default=48, help="batch-1 calls (one prompt each) per repeat")
    parser.add_argument("--batch-groups", type=int, default=32, help="groups per call of the default shape")
    parser.add_argument("--default-calls", type=int, default=4, help="default-shape calls per repeat")
    parser.add_argument("--tail-rows", type=lambda v: [int(b) for b in v.split(",")], default=[2, 4])
    parser.add_argument("--max-k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=6, help="the addition task's turn cap")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tail-shapes", action=argparse.BooleanOptionalAction, default=True,
                        help="also time tail1/tail2: 1 or 2 rows of a prompt whose other group-mates finished")
    print(json.dumps(run(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
