"""Acceptance of the `group` drafter under exact speculative sampling, and its wall time vs plain
decoding at batch sizes 1 to 8, in a reference loop outside the generator (results:
docs/measurements/speculative-accept-cpu2-2026-12-05.md).

Workload: `--prompts` addition prompts (train split, fixed seed). For each, a group of 8 is
first sampled with the plain `GroupSampler`; those completions feed the pool of recent
completions that later prompts may draft from. Then two speculative settings run against the
same target model through `accept_drafts`:

  live (batch 8): the prompt's 8 rows decoded together, each drafting from its siblings' tokens
    so far, its own, and the recent pool;
  tail (batch 1): one row decoded alone, drafting from the 7 sibling completions of the plain
    group (the long-tail case: the rest of its group has finished);
  reference (batch b in `--crossover`): b rows of the prompt decoded together, each drafting
    from all 8 plain completions (as when a prompt is sampled again in a later epoch): drafts as
    good as the tail's at every batch size, so where drafting stops paying shows the compute
    crossover itself.

The speculative loop here is a reference implementation, correctness first: each round feeds
every row's last token plus its drafts (right-padded) in ONE target forward over the KV cache of
the prefix; rejected drafts stay in the cache but are masked out, and positions are explicit.
`k=0` through the same loop ("loop, no drafts") separates the loop's own overhead from drafting.

Prints ONE JSON object: per temperature (1.0 and 0.7, top-p `--top-p`), acceptance rate (kept /
drafted), mean accepted length per drafting round, tokens per row per target forward (plain
decoding: 1), and for each batch size the
median over `--repeats` of wall and CPU microseconds per generated token for plain GroupSampler, the loop
without drafts, and the loop with the group drafter. One torch thread.

  .venv/bin/python bench/speculative_accept.py                 # the tests' tiny model
  .venv/bin/python bench/speculative_accept.py --model DIR --k 4
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

from rlbus.services.policy.drafters import GroupDrafter, RecentCompletions  # noqa: E402
from rlbus.services.policy.sampler import GroupSampler, StaticSlot, _stop_ids  # noqa: E402
from rlbus.services.policy.sampling import SamplingParams, processed_logprobs  # noqa: E402
from rlbus.services.policy.speculative import accept_drafts  # noqa: E402
from rlbus.services.policy.tokenizer import encode_prompt  # noqa: E402
from rlbus.services.tasks.addition import make_split  # noqa: E402


def _model(path: str | None) -> tuple[Any, Any]:
    from rlbus.services.policy.load import load_policy

    if path is None:  # the tests' fixture model: cached under tests/.cache, built when missing
        from rlbus.services.policy.model_init import init_model
        from tests.conftest import CACHE, _model_key

        folder = CACHE / f"tiny-addition-seed0-{_model_key()}"
        if not (folder / "config.json").exists():
            init_model(folder, seed=0, overwrite=True)
        path = str(folder)
    return load_policy(path)


@dataclass
class Counts:
    """What drafting did: rounds are target forwards after the prefill."""

    row_forwards: int = 0  # each unfinished row in each target forward, the prefill included
    tokens: int = 0
    drafted: int = 0
    kept: int = 0
    drafting_rounds: int = 0  # row-rounds that drafted at least one token

    def summary(self) -> dict[str, float]:
        return {
            "acceptance_rate": round(self.kept / max(self.drafted, 1), 4),
            "mean_accepted_len": round(self.kept / max(self.drafting_rounds, 1), 3),
            # per row: plain decoding gives exactly 1
            "tokens_per_target_forward": round(self.tokens / max(self.row_forwards, 1), 3),
        }


def speculative_decode(model: Any, prompt: list[int], drafter: GroupDrafter, rows: int, k: int,
                       params: SamplingParams, gen: torch.Generator, counts: Counts) -> list[list[int]]:
    """`rows` completions of `prompt`; row r drafts through `drafter` row r (k=0: no drafts)."""
    stop = set(_stop_ids(model, params))
    ids = torch.tensor([prompt] * rows)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    mask = torch.ones((rows, len(prompt)), dtype=torch.long)
    lp = processed_logprobs(out.logits[:, -1], params.temperature, params.top_p)
    last = lp.argmax(-1) if params.temperature == 0 else torch.multinomial(lp.exp(), 1, generator=gen).squeeze(-1)
    completions = [[int(t)] for t in last.tolist()]
    done = [c[-1] in stop or params.max_new_tokens == 1 for c in completions]
    for r, c in enumerate(completions):
        drafter.extend(r, c)
    next_pos = torch.full((rows,), len(prompt))
    counts.tokens += rows
    counts.row_forwards += rows
    while not all(done):
        drafts = [[] if done[r] else drafter.propose(r, min(k, params.max_new_tokens - len(completions[r]) - 1))
                  for r in range(rows)]
        width = max(len(d) for d in drafts)
        draft_ids = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long).reshape(rows, width)
        lens = torch.tensor([len(d) for d in drafts])
        block = torch.arange(width + 1)
        new_cols = (block[None, :] <= lens[:, None]).long()  # the last token and the real drafts
        fwd = model(input_ids=torch.cat([last[:, None], draft_ids], 1), attention_mask=torch.cat([mask, new_cols], 1),
                    position_ids=next_pos[:, None] + block[None, :], past_key_values=cache, use_cache=True)
        cache = fwd.past_key_values
        target = processed_logprobs(fwd.logits, params.temperature, params.top_p)
        v = accept_drafts(target, draft_ids, lens, gen, greedy=params.temperature == 0)
        # Rejected drafts stay in the cache, masked out from now on.
        mask = torch.cat([mask, (block[None, :] <= v.accepted[:, None]).long()], 1)
        next_pos = next_pos + v.emitted
        last = v.tokens.gather(1, v.accepted[:, None]).squeeze(-1)
        for r, (toks, _) in enumerate(v.rows()):
            if done[r]:
                continue
            counts.row_forwards += 1
            counts.drafted += len(drafts[r])
            counts.kept += int(v.accepted[r])
            counts.drafting_rounds += bool(drafts[r])
            for t in toks:
                completions[r].append(t)
                counts.tokens += 1
                if t in stop or len(completions[r]) == params.max_new_tokens:
                    done[r] = True
                    break
            drafter.extend(r, toks)
    return completions


def _timed(fn: Any, *args: Any) -> tuple[tuple[float, float], Any]:
    """(wall, process CPU) seconds of fn(*args), and its result. CPU time is the steadier figure
    on a shared machine (one torch thread)."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn(*args)
    return (time.perf_counter() - t0, time.process_time() - c0), result


class Repeat:
    """One pass over the prompts at one temperature: per mode, summed seconds and tokens."""

    def __init__(self, model: Any, k: int, params: SamplingParams, seed: int, crossover: list[int]) -> None:
        self.model, self.k, self.params, self.crossover = model, k, params, crossover
        self.sampler = GroupSampler(StaticSlot(model))
        self.gen = torch.Generator().manual_seed(seed)
        self.recent = RecentCompletions(recent=64)
        self.sums: dict[str, list[float]] = {}

    def _add(self, name: str, seconds: tuple[float, float], completions: list[list[int]]) -> None:
        s = self.sums.setdefault(name, [0.0, 0.0, 0])
        s[0] += seconds[0]
        s[1] += seconds[1]
        s[2] += sum(map(len, completions))

    def _plain(self, prompt: list[int], n: int) -> list[list[int]]:
        return [s.completion_ids for s in self.sampler.sample_groups([prompt], n, self.params, generator=self.gen)[0]]

    def _spec(self, prompt: list[int], drafter: GroupDrafter, rows: int, k: int, counts: Counts) -> list[list[int]]:
        return speculative_decode(self.model, prompt, drafter, rows, k, self.params, self.gen, counts)

    def prompt(self, prompt: list[int], live: Counts, tail: Counts, reference: dict[int, Counts]) -> None:
        sec, group = _timed(self._plain, prompt, 8)
        self._add("batch8/plain", sec, group)
        for rows in sorted({1, *self.crossover} - {8}):
            self._add(f"batch{rows}/plain", *_timed(self._plain, prompt, rows))
        for rows in self.crossover:
            drafter = GroupDrafter(rows)
            for completion in group:
                drafter.add_reference(completion)
            self._add(f"batch{rows}/reference_drafter",
                      *_timed(self._spec, prompt, drafter, rows, self.k, reference.setdefault(rows, Counts())))
        for rows in (8, 1):
            self._add(f"batch{rows}/loop_no_drafts", *_timed(self._spec, prompt, GroupDrafter(rows), rows, 0, Counts()))
        self._add("batch8/group_drafter",
                  *_timed(self._spec, prompt, GroupDrafter(8, recent=self.recent), 8, self.k, live))
        drafter = GroupDrafter(1, recent=self.recent)
        for sibling in group[1:]:
            drafter.add_reference(sibling)
        self._add("batch1/group_drafter", *_timed(self._spec, prompt, drafter, 1, self.k, tail))
        for completion in group:
            self.recent.add(completion)


def _medians(per_repeat: list[dict[str, list[float]]], column: int) -> dict[str, float]:
    names = sorted(per_repeat[0])
    return {n: round(statistics.median(r[n][column] / max(r[n][2], 1) for r in per_repeat) * 1e6, 1) for n in names}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, tokenizer = _model(args.model)
    prompts = [encode_prompt(tokenizer, t.prompt) for t in make_split("train", args.prompts, seed=args.seed)]
    report: dict[str, Any] = {"model": args.model or "tests tiny model", "prompts": args.prompts, "k": args.k,
                              "top_p": args.top_p, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                              "per_temperature": {}}
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
        live, tail = Counts(), Counts()  # acceptance over every repeat
        reference: dict[int, Counts] = {}
        repeats = []
        with torch.no_grad():
            for rep in range(args.repeats):
                r = Repeat(model, args.k, params, args.seed + rep, args.crossover)
                for prompt in prompts:
                    r.prompt(prompt, live, tail, reference)
                repeats.append(r.sums)
        wall, cpu = _medians(repeats, 0), _medians(repeats, 1)
        report["per_temperature"][str(temperature)] = {
            "live_batch8": live.summary(), "tail_batch1": tail.summary(),
            "reference": {f"batch{b}": c.summary() for b, c in sorted(reference.items())},
            "wall_us_per_token_median": wall, "cpu_us_per_token_median": cpu,
            "wall_speedup_vs_plain": {f"batch{b}": round(wall[f"batch{b}/plain"] / wall[f"batch{b}/group_drafter"], 3)
                                      for b in (1, 8)},
            "cpu_speedup_vs_plain": {f"batch{b}": round(cpu[f"batch{b}/plain"] / cpu[f"batch{b}/group_drafter"], 3)
                                     for b in (1, 8)},
            "cpu_speedup_reference_drafter_vs_plain": {
                f"batch{b}": round(cpu[f"batch{b}/plain"] / cpu[f"batch{b}/reference_drafter"], 3) for b in args.crossover},
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="policy folder (default: the tests' tiny model)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--k", type=int, default=4, help="most tokens drafted per row per round")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crossover", type=lambda v: [int(b) for b in v.split(",")], default=[1, 2, 4, 8],
                        help="batch sizes for the reference-drafter runs, comma-separated")
    print(json.dumps(run(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
