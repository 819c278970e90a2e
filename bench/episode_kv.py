"""KV kept across turns vs recompute every turn, on the PyTorch episode engine.

Workload: `--episodes` multi-turn episodes (2–4 policy turns each, drawn with a fixed seed) of
3-digit addition prompts, at most `--concurrency` open at a time; a finished episode's slot is
refilled at once (continuous batching), as the generator's episode driver does. Each turn samples
up to `--turn-tokens` tokens at temperature 1; between turns the "environment" appends an
observation of 3–6 tokens at once (no tool latency: this measures the engine, not the tools).
Both modes run the same workload with the same engine and seed; "recompute" is
`EpisodeEngine(keep_kv=False)`, which drops a row's cache at every turn start so the whole
sequence is prefilled again.

Model: the tiny Qwen2 (services/policy/model_init.py); `--model DIR` loads a trained folder, by
default the untrained architecture is used (same compute; its turns end at eos less often).
Its context is 64 tokens, so episodes are short; `--max-positions N` builds the same
architecture with a longer context and scales turns and observations with it (an untrained
model: the figure is about cost, not answers).

`--hidden N` widens it (the tiny model's forwards cost little more for 200 tokens than for one,
so per-step overhead hides the prefill it saves).

Prints ONE JSON object: per mode the median over `--repeats` of wall and process-CPU seconds per
episode (one torch thread: CPU time is the steadier figure on a shared machine) and prefill
tokens per episode, and recompute/kept ratios; with `--single-turn`, also single-turn sampling
(32 prompts x 8 samples x <= 16 tokens) through GroupSampler and through the engine, in tokens
per CPU second (single-turn runs must not get slower on the engine).  Results:
docs/measurements/episode-kv-cpu2-2026-12-05.md, single-turn-path-cpu2-2026-12-06.md.

  .venv/bin/python bench/episode_kv.py --single-turn        # tiny model, context 64
  .venv/bin/python bench/episode_kv.py --max-positions 512  # longer episodes
  .venv/bin/python bench/episode_kv.py --max-positions 512 --hidden 512 --episodes 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlbus.services.policy.episodes import EpisodeEngine  # noqa: E402
from rlbus.services.policy.model_init import tiny_config  # noqa: E402
from rlbus.services.policy.sampler import StaticSlot  # noqa: E402
from rlbus.services.policy.sampling import SamplingParams  # noqa: E402
from rlbus.services.policy.tokenizer import build_char_tokenizer, encode_prompt  # noqa: E402
from rlbus.services.tasks.addition import make_split  # noqa: E402


def _model(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    if args.model:
        from rlbus.services.policy.load import load_policy

        return load_policy(args.model)
    tokenizer = build_char_tokenizer()
    config = tiny_config(tokenizer)
    if args.max_positions:
        config.max_position_embeddings = args.max_positions
    if args.hidden:  # a wider model, where a prefilled token costs more than per-step overhead
        config.hidden_size, config.intermediate_size = args.hidden, 4 * args.hidden
        config.num_attention_heads, config.num_key_value_heads = args.hidden // 32, max(1, args.hidden // 64)
    torch.manual_seed(0)
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM(config).eval(), tokenizer


class Workload:
    """Episodes to run: prompt, number of turns, observation per turn; the same for both modes."""

    def __init__(self, tokenizer: Any, episodes: int, context: int, turn_tokens: int, seed: int) -> None:
        rng = random.Random(seed)
        tasks = make_split("train", episodes, seed=seed)
        scale = max(1, context // 64)
        self.turn_tokens = turn_tokens * scale
        self.items: list[tuple[list[int], int, list[list[int]]]] = []
        for task in tasks:
            turns = rng.randint(2, 4)
            obs = [[rng.randrange(3, 30) for _ in range(rng.randint(3, 6) * scale)] for _ in range(turns - 1)]
            self.items.append((encode_prompt(tokenizer, task.prompt), turns, obs))


def _run(engine: EpisodeEngine, work: Workload, concurrency: int, seed: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of the whole workload."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    queue = list(enumerate(work.items))
    live: dict[str, tuple[int, int]] = {}  # key -> (item index, turns done)

    def admit() -> None:
        while queue and len(live) < concurrency:
            i, (prompt, _, _) = queue.pop(0)
            key = f"ep{i}"
            engine.open([key], prompt)
            engine.start_turn(key, params, [], work.turn_tokens)
            live[key] = (i, 0)

    t0, c0 = time.perf_counter(), time.process_time()
    admit()
    while live:
        for key, _turn in engine.run(gen, max_steps=16):
            i, done = live[key]
            _, turns, obs = work.items[i]
            done += 1
            room = engine.room(key)
            if done < turns and room is not None and room > len(obs[done - 1]):
                engine.append(key, obs[done - 1])
                engine.start_turn(key, params, [], work.turn_tokens)
                live[key] = (i, done)
            else:
                engine.close(key)
                del live[key]
        admit()
    return time.perf_counter() - t0, time.process_time() - c0


def _tokens_per_cpu_s(sample: Any) -> float:
    c0 = time.process_time()
    tokens = sample()
    return tokens / (time.process_time() - c0)


def _single_turn(model: torch.nn.Module, tokenizer: Any, repeats: int) -> dict[str, float]:
    """Single-turn sampling, GroupSampler vs the engine: 32 prompts x 8 samples x <= 16 tokens."""
    from rlbus.services.policy.sampler import GroupSampler

    prompts = [encode_prompt(tokenizer, t.prompt) for t in make_split("train", 32, seed=1)]
    params = SamplingParams(temperature=1.0, max_new_tokens=16)

    def sampler() -> int:
        groups = GroupSampler(StaticSlot(model)).sample_groups(prompts, 8, params, torch.Generator().manual_seed(0))
        return sum(len(s.completion_ids) for g in groups for s in g)

    def engine() -> int:
        e = EpisodeEngine(StaticSlot(model))
        for i, prompt in enumerate(prompts):
            keys = [f"{i}/{j}" for j in range(8)]
            e.open(keys, prompt)
            for key in keys:
                e.start_turn(key, params, [], params.max_new_tokens, final=True)
        gen, tokens = torch.Generator().manual_seed(0), 0
        while done := e.run(gen, max_steps=16):
            tokens += sum(len(turn.ids) for _, turn in done)
        return tokens

    rates: dict[str, list[float]] = {"group_sampler": [], "engine": []}
    for r in range(repeats + 1):  # alternate, after one warm-up round
        for name, fn in (("group_sampler", sampler), ("engine", engine)):
            rate = _tokens_per_cpu_s(fn)
            if r:
                rates[name].append(rate)
    out = {f"{k}_tokens_per_cpu_s": statistics.median(v) for k, v in rates.items()}
    out["engine_over_group_sampler"] = out["engine_tokens_per_cpu_s"] / out["group_sampler_tokens_per_cpu_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a policy folder (default: the untrained tiny architecture)")
    ap.add_argument("--max-positions", type=int, default=0, help="context of the untrained model (default 64)")
    ap.add_argument("--hidden", type=int, default=0, help="hidden size of the untrained model (default 128)")
    ap.add_argument("--episodes", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--turn-tokens", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--single-turn", action="store_true",
                    help="also compare single-turn sampling: GroupSampler vs the engine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = _model(args)
    context = int(model.config.max_position_embeddings)
    work = Workload(tokenizer, args.episodes, context, args.turn_tokens, seed=0)
    results: dict[str, dict[str, float]] = {}
    for mode, keep in (("kept", True), ("recompute", False)):
        walls: list[float] = []
        cpus: list[float] = []
        prefill: list[float] = []
        reused: list[float] = []
        tokens: list[float] = []
        for r in range(args.repeats + 1):  # the first round warms up the kernels
            engine = EpisodeEngine(StaticSlot(model), keep_kv=keep)
            wall, cpu = _run(engine, work, args.concurrency, seed=r)
            if r:
                walls.append(wall / args.episodes)
                cpus.append(cpu / args.episodes)
                prefill.append(engine.stats["prefill_tokens"] / args.episodes)
                reused.append(engine.stats["reused_tokens"] / args.episodes)
                tokens.append(engine.stats["decode_tokens"] / args.episodes)
        results[mode] = {"wall_s_per_episode": statistics.median(walls),
                         "cpu_s_per_episode": statistics.median(cpus),
                         "prefill_tokens_per_episode": statistics.median(prefill),
                         "sampled_tokens_per_episode": statistics.median(tokens),
                         "reused_tokens_per_episode": statistics.median(reused)}
    kept, rec = results["kept"], results["recompute"]
    print(json.dumps({
        "model": args.model or "untrained tiny Qwen2", "hidden": int(model.config.hidden_size), "context": context, "episodes": args.episodes,
        "concurrency": args.concurrency, "repeats": args.repeats, "threads": args.threads,
        "turn_tokens": work.turn_tokens, **results,
        "prefill_ratio_recompute_over_kept": rec["prefill_tokens_per_episode"] / max(kept["prefill_tokens_per_episode"], 1e-9),
        "wall_ratio_recompute_over_kept": rec["wall_s_per_episode"] / kept["wall_s_per_episode"],
        "cpu_ratio_recompute_over_kept": rec["cpu_s_per_episode"] / kept["cpu_s_per_episode"],
        **({"single_turn": _single_turn(model, tokenizer, args.repeats)} if args.single_turn else {}),
    }, indent=2))


if __name__ == "__main__":
    main()
