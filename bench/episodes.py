"""Multi-turn episodes with a slow, uneven tool: per-episode scheduling vs batch-synchronous turns.

The workload: ``--episodes`` episodes of ``--turns`` policy turns each on the tiny model; after every
turn but the last, a tool answers after a random latency (long-tailed: log-normal, median 60 ms,
clipped to 0-500 ms; the same draws for both schedules) with a few observation tokens.  At most
``--concurrency`` episodes are in flight.

- ``per_episode``: the generator's own ``EpisodeDriver`` (services/generator/episodes.py) on the
  in-memory bus, with a real ``TorchBackend``: a turn that ends goes to the tool at once while the
  other episodes keep decoding, and a finished episode's slot is refilled at once.
- ``batch_sync``: the same engine driven turn by turn in lockstep, as a sampler without per-episode
  scheduling does: a wave of ``--concurrency`` episodes decodes a turn until every row ends it, then
  waits for every tool call of the wave (the slowest sets the pace), and the next wave starts only
  when the whole wave is done.

Both count policy tokens per wall second; the ratio per_episode / batch_sync is what to read.  Then
the KV cache kept across turns against recomputing the whole prefix each turn (the same engine with
``keep_kv=False``): prefill tokens and wall time per episode, tool latency off.

    .venv/bin/python -m bench.episodes [--model models/tiny-addition --episodes 48 --turns 3 --concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

OBSERVATION = " ok "  # what the tool answers (its latency is what matters here)


def latency_s(episode: int, turn: int, seed: int) -> float:
    rng = random.Random(zlib.crc32(f"{seed}/{episode}/{turn}".encode()))
    return min(rng.lognormvariate(np.log(0.06), 1.0), 0.5)


def prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    from rlbus.services.policy.tokenizer import encode_prompt
    from rlbus.services.tasks.addition import make_split

    return [list(encode_prompt(tokenizer, t.prompt)) for t in make_split("train", n, seed)]


# --- batch-synchronous turns on the engine -------------------------------------------------------
async def batch_sync(engine: Any, work: list[list[int]], obs: list[int], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rlbus.services.policy.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.tokens)
    rng = torch.Generator().manual_seed(args.seed)
    tokens, t0 = 0, time.perf_counter()
    for wave in range(0, len(work), args.concurrency):
        keys = [f"e{i}" for i in range(wave, min(wave + args.concurrency, len(work)))]
        for i, key in zip(range(wave, wave + len(keys)), keys, strict=True):
            engine.open([key], work[i])
        for turn in range(1, args.turns + 1):
            for key in keys:
                engine.start_turn(key, params, [], args.tokens)
            left = set(keys)
            while left:
                for key, t in await asyncio.to_thread(engine.run, rng, 8):
                    left.discard(key)
                    tokens += len(t.ids)
            if turn < args.turns:  # every tool call of the wave, the slowest one sets the pace
                await asyncio.gather(*(asyncio.sleep(latency_s(int(k[1:]), turn, args.seed)) for k in keys))
                for key in keys:
                    engine.append(key, obs)
        for key in keys:
            engine.close(key)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "policy_tokens": tokens, "tokens_per_s": tokens / wall}


# --- the generator's episode driver on the in-memory bus -----------------------------------------
async def per_episode(backend: Any, work: list[list[int]], obs: list[int], args: argparse.Namespace,
                      run_dir: Path) -> dict[str, Any]:
    from rlbus.bus.memory import MemoryBus
    from rlbus.schemas import (
        EnvReply,
        EnvReplyBatch,
        EnvResetBatch,
        EnvStep,
        EpisodeLimits,
        RolloutGroup,
        SamplingParams,
        Task,
    )
    from rlbus.services.generator import service as generator_service
    from rlbus.services.generator.settings import GeneratorSettings
    from rlbus.services.runtime.config import RunSettings
    from rlbus.services.runtime.lifecycle import Lifecycle

    bus = MemoryBus("bench")
    s = bus.subjects
    prompt_of = {f"t{i}": p for i, p in enumerate(work)}

    async def reset_batch(data: bytes) -> bytes:
        tasks = EnvResetBatch.decode(data).tasks
        return EnvReplyBatch(replies=[EnvReply(episode_id=t.task_id, episodic=True,
                                               observation_ids=np.asarray(prompt_of[t.task_id], "<i4"))
                                      for t in tasks]).encode()

    async def step(data: bytes) -> bytes:
        req = EnvStep.decode(data)
        if req.turn >= args.turns:
            return EnvReply(episode_id=req.episode_id, replica="env-0", done=True, finish_reason="done").encode()
        await asyncio.sleep(latency_s(int(req.task.task_id[1:]), req.turn, args.seed))
        return EnvReply(episode_id=req.episode_id, replica="env-0", observation_ids=np.asarray(obs, "<i4")).encode()

    await bus.serve(s.env_any("reset_batch"), reset_batch, queue="environment")
    await bus.serve(s.env_any("step"), step, queue="environment")
    await bus.serve(s.env_step_of("env-0"), step, queue="env-0")
    run_cfg = RunSettings(run="bench", run_dir=str(run_dir), pools=["train"], group_size=1, batch_groups=8)
    cfg = GeneratorSettings(instance="gen-0", admission=False, max_batch_groups=args.concurrency, min_batch_groups=1,
                            batch_wait_s=0.0, seed=args.seed, env_timeout=30.0)
    life = Lifecycle(grace=2.0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.tokens)
    t0 = time.perf_counter()
    for task_id in prompt_of:
        t = Task(run="bench", task_id=task_id, pool="train", env="bench", prompt_ids=np.asarray(prompt_of[task_id], "<i4"),
                 group_size=1, sampling=sampling, limits=EpisodeLimits(max_turns=args.turns))
        await bus.publish(s.tasks("train"), t.encode(), msg_id=t.msg_id)
    service = asyncio.create_task(generator_service.run(run_cfg, cfg, bus=bus, life=life, backend=backend))
    while len(bus.messages("ROLLOUTS")) < len(work):
        if service.done():
            service.result()
        await asyncio.sleep(0.01)
    wall = time.perf_counter() - t0
    groups = [RolloutGroup.decode(d) for _, d in bus.messages("ROLLOUTS")]
    life.shutdown()
    await asyncio.wait_for(service, 10)
    await bus.close()
    tokens = sum(int(r.loss_mask.sum()) for g in groups for r in g.rollouts)
    turns = [r.turns for g in groups for r in g.rollouts]
    return {"wall_s": wall, "policy_tokens": tokens, "tokens_per_s": tokens / wall,
            "turns_per_episode": statistics.mean(turns)}


# --- KV kept across turns vs recomputed ----------------------------------------------------------
def kv_cost(slot: Any, work: list[list[int]], obs: list[int], args: argparse.Namespace, keep_kv: bool) -> dict[str, Any]:
    import torch

    from rlbus.services.policy.episodes import EpisodeEngine
    from rlbus.services.policy.sampling import SamplingParams

    engine = EpisodeEngine(slot, keep_kv=keep_kv)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.tokens)
    rng = torch.Generator().manual_seed(args.seed)
    keys = [f"k{i}" for i in range(len(work))]
    t0 = time.perf_counter()
    for key, prompt in zip(keys, work, strict=True):
        engine.open([key], prompt)
    for turn in range(1, args.turns + 1):
        for key in keys:
            engine.start_turn(key, params, [], args.tokens)
        left = set(keys)
        while left:
            for key, _ in engine.run(rng, 8):
                left.discard(key)
        if turn < args.turns:
            for key in keys:
                engine.append(key, obs)
    wall = time.perf_counter() - t0
    stats = engine.stats
    return {"prefill_tokens_per_episode": stats["prefill_tokens"] / len(keys),
            "reused_tokens_per_episode": stats["reused_tokens"] / len(keys), "wall_s_per_episode": wall / len(keys)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-addition", help="Hugging Face folder (rlbus init-model)")
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8, help="max new tokens per turn")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(f"no model at {args.model}: run `rlbus init-model --out {args.model}` first")
    import tempfile

    import torch

    from rlbus.observability.logging import configure_logging
    from rlbus.services.generator.torch_backend import TorchBackend

    configure_logging(service="bench", run="episodes", level="WARNING")  # logs to stderr: stdout is the JSON
    torch.set_num_threads(1)
    backend = TorchBackend(args.model)
    tok = backend.tokenizer
    obs = list(tok.encode(OBSERVATION, add_special_tokens=False))
    out: dict[str, Any] = {"workload": {k: getattr(args, k) for k in ("episodes", "turns", "tokens", "concurrency",
                                                                         "reps", "seed")},
                           "tool_latency": "log-normal, median 60 ms, clipped to 500 ms"}
    runs: dict[str, list[dict[str, Any]]] = {"per_episode": [], "batch_sync": []}
    for rep in range(args.reps):
        work = prompts(tok, args.episodes, args.seed + rep)
        with tempfile.TemporaryDirectory() as run_dir:
            runs["per_episode"].append(asyncio.run(per_episode(backend, work, obs, args, Path(run_dir))))
        from rlbus.services.policy.episodes import EpisodeEngine

        runs["batch_sync"].append(asyncio.run(batch_sync(EpisodeEngine(backend.slot), work, obs, args)))
    for name, rs in runs.items():
        out[name] = {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
                     "wall_s_median": statistics.median(r["wall_s"] for r in rs), "runs": rs}
    out["per_episode_over_batch_sync"] = out["per_episode"]["tokens_per_s_median"] / out["batch_sync"]["tokens_per_s_median"]
    work = prompts(tok, args.concurrency, args.seed)
    kept = [kv_cost(backend.slot, work, obs, args, keep_kv=True) for _ in range(args.reps)]
    redo = [kv_cost(backend.slot, work, obs, args, keep_kv=False) for _ in range(args.reps)]
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in (("kv_kept", kept),
                                                                                           ("recompute", redo))}
    out["kv"] = {**med, "prefill_ratio_recompute_over_kept": med["recompute"]["prefill_tokens_per_episode"]
                 / med["kv_kept"]["prefill_tokens_per_episode"],
                 "wall_ratio_recompute_over_kept": med["recompute"]["wall_s_per_episode"]
                 / med["kv_kept"]["wall_s_per_episode"]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
