"""Greedy held-out accuracy of trained policies on a larger held-out set than the live 200-task rounds.

A 200-task round has ~0.035 standard error, so a run that stops on its rounds can stop on a lucky
one; this scores whole Hugging Face folders (a run's `final_policy`, the warm start) on `--tasks`
held-out tasks drawn under another seed, with the evaluation function the TRL comparison uses.

    .venv/bin/python bench/heldout_eval.py models/tiny-addition runs/<run>/final_policy
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.trl_grpo import _tokenizer_with_bos, greedy_heldout_accuracy  # noqa: E402
from rlbus.services.tasks.addition import AdditionTask, make_split  # noqa: E402

CHUNK = 500  # prompts per generate call: bounds the batch's memory, not the result


def accuracy(folder: Path, tasks: list[AdditionTask]) -> float:
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    tokenizer = _tokenizer_with_bos(str(folder))
    correct = sum(greedy_heldout_accuracy(policy, tokenizer, tasks[i:i + CHUNK]) * len(tasks[i:i + CHUNK])
                  for i in range(0, len(tasks), CHUNK))
    return correct / len(tasks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path, help="Hugging Face policy folders")
    p.add_argument("--tasks", type=int, default=2000, help="held-out tasks to score")
    p.add_argument("--seed", type=int, default=7, help="held-out draw (the live rounds use seed 0)")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.folders if not (f / "config.json").exists()]
    if missing:
        print(f"heldout_eval: no Hugging Face folder at {', '.join(missing)}: pass a run's final_policy "
              "or a model built by `rlbus init-model`", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    tasks = make_split("heldout", args.tasks, args.seed)
    result = {"bench": "heldout_eval", "tasks": args.tasks, "seed": args.seed, "decoding": "greedy",
              "accuracy": {str(f): round(accuracy(f, tasks), 4) for f in args.folders}}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
