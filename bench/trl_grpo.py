"""TRL's GRPOTrainer on the 3-digit addition task: the reference that bench/vs_trl.py races rlbus against.

Same recipe as `rlbus up` (the design brief's "Reference learning curve"): the same warm-start
Hugging Face folder, 32 prompts x 8 samples per optimiser step, AdamW lr 1e-4 constant, no KL
(beta 0), temperature 1.0, at most 6 new tokens, clip 0.2 / 0.28 (rlbus's clip_low/clip_high),
token-mean loss ("dapo"), group-std advantages, grad clip 1.0, one torch thread, CPU, no vLLM.

Prompts are the raw text "123+456="; the tokenizer gets a post-processor that prepends `<bos>`,
so TRL feeds the policy exactly the ids the rlbus environment sends (`encode_prompt`). Generation
stops at `<eos>` (TRL masks everything after the first eos). The reward decodes the completion ids
(special tokens kept, so "57<bos>9" is wrong here as it is in rlbus) and calls `score`.

Held-out accuracy: every `--eval-every` optimiser steps, greedy decoding of the 200 held-out
prompts (make_split("heldout", 200, 0), the set `rlbus up` and `rlbus init-model` use) at the
current weights, model in eval mode then back to train mode. The time spent evaluating is NOT on
TRL's clock (rlbus evaluates inside its own pipeline, concurrently, and that time IS on its clock).
The clock starts at `on_train_begin` (after the model, dataset and trainer are built).

Run alone:  .venv/bin/python bench/trl_grpo.py --model models/tiny-addition --budget 600 --out trl.json
Needs the `bench` extra:  pip install 'trl==1.16.*' datasets accelerate   (keeps torch==2.13.0)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rlbus.services.policy.tokenizer import encode_prompt  # noqa: E402
from rlbus.services.tasks.addition import AdditionTask, make_split, score  # noqa: E402

GROUP_SIZE = 8
PROMPTS_PER_STEP = 32
LEARNING_RATE = 1e-4
MAX_NEW_TOKENS = 6
TEMPERATURE = 1.0
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # rlbus [trainer.objective] clip_low / clip_high defaults
EVAL_TASKS = 200
EVAL_SEED = 0  # the held-out set of `rlbus up` (up.seed 0) and of `rlbus init-model`
# `rlbus up` publishes its training tasks once and consumes each one once (no epochs): with its
# default 8192 the pool ran dry after ~208 steps (32 trained + ~7 zero-variance groups dropped per
# step) and the pipeline idled. 65536 lasts well past any 600 s budget; TRL gets the same set.
TRAIN_TASKS = 65536
TRAIN_SEED = 0


def _tokenizer_with_bos(model_path: str) -> Any:
    """The model's tokenizer, plus a post-processor that puts `<bos>` in front of every text.

    The rlbus tokenizer deliberately adds nothing on encode (the environment adds `<bos>`); TRL
    tokenizes raw prompts with `processing_class(text=prompts)`, so the bos goes here.
    """
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, int(tok.bos_token_id))]
    )
    return tok


def greedy_heldout_accuracy(model: Any, tokenizer: Any, tasks: list[AdditionTask]) -> float:
    """Greedy completions of `tasks` at the current weights (eval mode, restored afterwards)."""
    from transformers import GenerationConfig

    was_training = model.training
    model.eval()
    ids = [encode_prompt(tokenizer, t.prompt) for t in tasks]
    width = max(len(i) for i in ids)
    pad = int(tokenizer.pad_token_id)
    # Left padding (every "ddd+ddd=" prompt has the same length, so normally there is none).
    input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    attention = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    cfg = GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=int(tokenizer.eos_token_id),
                           pad_token_id=pad, bos_token_id=int(tokenizer.bos_token_id))
    try:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=cfg)
    finally:
        model.train(was_training)
    correct = 0.0
    for task, row in zip(tasks, out[:, width:].tolist(), strict=True):
        correct += score(task.answer, tokenizer.decode(row, skip_special_tokens=False))
    return correct / len(tasks)


def first_time_at(curve: list[dict[str, Any]], threshold: float) -> float | None:
    for point in curve:
        if point["acc"] >= threshold:
            return point["t"]
    return None


@dataclass
class _Clock:
    start: float = 0.0
    excluded: float = 0.0  # seconds spent evaluating, taken off the training clock
    evals: int = 0
    stop_why: str = "max_steps"


def run_trl(model_path: str, budget: float, *, eval_every: int = 2, stop_at: float = 0.9, seed: int = 0,
            log: Any = print) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tokenizer = _tokenizer_with_bos(model_path)
    heldout = make_split("heldout", EVAL_TASKS, EVAL_SEED)
    sample = heldout[0].prompt
    got = tokenizer(text=[sample])["input_ids"][0]
    want = encode_prompt(tokenizer, sample)
    if list(got) != want:
        raise SystemExit(f"tokenizer does not reproduce the rlbus prompt ids: {got} != {want}")
    train = make_split("train", TRAIN_TASKS, TRAIN_SEED)
    dataset = Dataset.from_list([{"prompt": t.prompt, "answer": t.answer} for t in train])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    def addition_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                        answer: list[str], **_: Any) -> list[float]:
        return [score(a, tokenizer.decode(ids, skip_special_tokens=False))
                for a, ids in zip(answer, completion_ids, strict=True)]

    curve: list[dict[str, Any]] = []
    clock = _Clock()

    def now() -> float:
        return time.perf_counter() - clock.start - clock.excluded

    def evaluate(m: Any, step: int) -> float:
        t = now()
        e0 = time.perf_counter()
        acc = greedy_heldout_accuracy(m, tokenizer, heldout)
        clock.excluded += time.perf_counter() - e0
        clock.evals += 1
        curve.append({"t": round(t, 3), "acc": acc, "step": step})
        log(f"trl: step {step:4d} t {t:7.1f}s held-out {acc:.3f}")
        return acc

    class HeldOut(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            clock.start = time.perf_counter()
            evaluate(model, 0)

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            step = state.global_step
            if step % eval_every == 0:
                acc = evaluate(model, step)
                if stop_at and acc >= stop_at:
                    clock.stop_why = f"held-out {acc:.3f} >= {stop_at}"
                    control.should_training_stop = True
            if now() >= budget and not control.should_training_stop:
                clock.stop_why = f"budget {budget}s"
                control.should_training_stop = True

    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as out_dir:
        cfg = trl.GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=GROUP_SIZE * PROMPTS_PER_STEP,  # 256 completions = 32 prompts x 8
            gradient_accumulation_steps=1,
            num_generations=GROUP_SIZE,
            steps_per_generation=1,  # one optimiser step per generated batch: on-policy
            num_iterations=1,
            max_completion_length=MAX_NEW_TOKENS,
            temperature=TEMPERATURE,
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",  # rlbus keeps lr fixed; TRL's default decays linearly
            warmup_steps=0,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            max_grad_norm=1.0,
            beta=0.0,
            epsilon=CLIP_LOW,
            epsilon_high=CLIP_HIGH,
            loss_type="dapo",  # token mean over the batch = rlbus [trainer.objective] aggregation "token_mean"
            scale_rewards="group",  # = rlbus [trainer.advantages] normalize_std = true
            max_steps=100_000,  # the callback stops training
            use_cpu=True,
            bf16=False,
            fp16=False,
            use_vllm=False,
            report_to=[],
            logging_steps=10,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=seed,
            log_completions=False,
        )
        trainer = trl.GRPOTrainer(model=model, reward_funcs=[addition_reward], args=cfg,  # type: ignore[list-item]
                                  train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=[HeldOut()])
        ids = tokenizer(text=[sample])["input_ids"][0]
        if trainer.processing_class is not tokenizer:
            raise SystemExit("GRPOTrainer replaced the tokenizer: the <bos> post-processor would be lost")
        if list(ids) != want:
            raise SystemExit(f"GRPOTrainer changed the prompt ids: {ids} != {want}")
        wall0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - wall0
        steps = int(trainer.state.global_step)
    train_s = now()
    return {
        "system": "trl",
        "trl_version": trl.__version__,
        "torch_version": torch.__version__,
        "model": model_path,
        "t_to_0.8": first_time_at(curve, 0.8),
        "t_to_0.9": first_time_at(curve, 0.9),
        "steps": steps,
        "s_per_step": round(train_s / steps, 4) if steps else None,
        "train_seconds": round(train_s, 3),
        "eval_seconds_excluded": round(clock.excluded, 3),
        "wall_seconds": round(wall, 3),
        "evals": clock.evals,
        "stopped": clock.stop_why,
        "clock": ("seconds since TRL on_train_begin, minus time spent in the held-out evaluation callback "
                  f"(greedy, {EVAL_TASKS} prompts, every {eval_every} steps)"),
        "curve": curve,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny-addition", help="warm-start Hugging Face folder")
    p.add_argument("--budget", type=float, default=600.0, help="training seconds (evaluation excluded) before giving up")
    p.add_argument("--eval-every", type=int, default=2, help="optimiser steps between held-out evaluations")
    p.add_argument("--stop-at", type=float, default=0.9, help="stop once held-out accuracy reaches this (0 = never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the result JSON here (always printed on stdout)")
    args = p.parse_args(argv)
    if not (Path(args.model) / "config.json").exists():
        print(f"trl_grpo: no model at {args.model}: build one with `rlbus init-model --out {args.model}`",
              file=sys.stderr)
        return 2
    result = run_trl(args.model, args.budget, eval_every=args.eval_every, stop_at=args.stop_at, seed=args.seed,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
