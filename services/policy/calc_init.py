"""Build the tiny policy warm-started on calculator *episodes* (``rlbus init-model --task calculator``).

Why it exists: the tiny policy never calls a tool by itself, so RL on the calculator task from the
addition model would see no tool round and almost no reward.  This warm start is supervised on
generated transcripts of the episode format, token for token what the episode driver produces:

    <bos>123+456+789+101=  calc(123+456+789+101)  =1469   1469<eos>
    prompt (no loss)       tool turn (loss)       obs.    final turn (loss)
                                                  (no loss: the environment's tokens)

and it stops at a partial held-out accuracy (``DEFAULT_TARGET``), measured by playing greedy
episodes against the real calculator tool, so RL has room to show learning.  The tool turn ends at
its closing parenthesis: the task files set the stop string ``")"`` (the driver cuts the turn
there), so the policy never has to learn to stop after the call.

Determinism: the same seed gives the same weights (torch.manual_seed, a fixed data order, one
thread).  The architecture, optimiser and schedule are the addition warm start's
(``rlbus.services.policy.model_init``), imported from there so both models stay the same kind of model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast, Qwen2ForCausalLM

from rlbus.services.policy.model_info import MODEL_INFO_FILE, install_folder
from rlbus.services.policy.model_init import (
    ADAM_BETAS,
    BATCH_SIZE,
    WARMUP_STEPS,
    Log,
    ModelInitError,
    tiny_config,
)
from rlbus.services.policy.sampler import GroupSampler, StaticSlot
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.policy.tokenizer import build_char_tokenizer, encode_prompt
from rlbus.services.tasks.calculator import (
    CalcError,
    CalculatorTask,
    evaluate,
    find_call,
    make_split,
    observation,
    score,
)

TASK = "calculator"
DEFAULT_TARGET = 0.30
HELDOUT_EVAL_SIZE = 200
HELDOUT_EVAL_SEED = 0
TRAIN_POOL_SIZE = 50_000
# The stop string that ends a tool turn (task files carry it in sampling.stop).
TOOL_STOP = ")"
# A tool turn is `calc(` + four 3-digit terms and three '+' + `)`: 21 tokens; the final turn is at
# most four digits and <eos>.  One cap serves both turns (Task.sampling has one max_new_tokens).
TURN_TOKENS = 24
ANSWER_TOKENS = 5
LEARNING_RATE = 1e-3
EVAL_EVERY = 25
EVAL_EVERY_NEAR_TARGET = 5
# Accuracy is ~0 on a loss plateau (0.25-0.30 for seed 0, steps 120-195: the format is learnt, copying
# the terms is not), then jumps within a few steps as copying appears (seed 0: 0.175 at step 200,
# 0.825 at step 205).  Below this loss every step is evaluated, so the start stops near the target.
COPYING_LOSS = 0.2


def tool_call(task: CalculatorTask) -> tuple[str, str]:
    """The tool turn the transcripts teach (the prompt's sum, handed to the calculator as written) and
    the observation the calculator answers it with."""
    expression = "+".join(str(t) for t in task.terms)
    return "calc(" + expression + TOOL_STOP, observation(evaluate(expression))


def transcript_rows(tokenizer: PreTrainedTokenizerFast, tasks: Sequence[CalculatorTask]) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per task: the episode's whole token sequence; the loss covers the policy's two
    turns (the call; the answer and <eos>), never the prompt or the environment's observation."""
    eos = int(tokenizer.eos_token_id)
    rows = []
    for task in tasks:
        prompt = encode_prompt(tokenizer, task.prompt)
        call_text, obs_text = tool_call(task)
        call = list(tokenizer.encode(call_text, add_special_tokens=False))
        obs = list(tokenizer.encode(obs_text, add_special_tokens=False))
        answer = [*tokenizer.encode(task.answer, add_special_tokens=False), eos]
        rows.append(([*prompt, *call, *obs, *answer],
                     [0] * len(prompt) + [1] * len(call) + [0] * len(obs) + [1] * len(answer)))
    return rows


def training_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and next-token targets (-100 where the loss mask is 0 or past the row)."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width - 1), -100, dtype=torch.long)
    for r, (seq, mask) in enumerate(rows):
        ids[r, : len(seq)] = torch.tensor(seq)
        for j in range(1, len(seq)):
            if mask[j]:
                targets[r, j - 1] = seq[j]  # position j-1 predicts token j
    return ids, targets


def play_greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                tasks: Sequence[CalculatorTask]) -> list[str]:
    """Each task's greedy two-turn episode against the real calculator tool, as the completion text a
    rollout carries (tool turn, observation, final turn).  The tool turn is cut at ``TOOL_STOP`` as the
    driver cuts it; a turn without a call is the final answer; a malformed call ends the episode."""
    sampler = GroupSampler(StaticSlot(model))
    params = SamplingParams(temperature=0.0, max_new_tokens=TURN_TOKENS, stop_token_ids=(int(tokenizer.eos_token_id),))
    prompts = [encode_prompt(tokenizer, t.prompt) for t in tasks]
    stop_id = int(tokenizer.convert_tokens_to_ids(TOOL_STOP))
    context = int(model.config.max_position_embeddings)
    texts: list[str] = []
    second: list[tuple[int, list[int]]] = []  # (task index, prompt of the final turn)
    for i, group in enumerate(sampler.sample_groups(prompts, 1, params)):
        ids = list(group[0].completion_ids)
        if stop_id in ids:
            ids = ids[: ids.index(stop_id) + 1]
        text = str(tokenizer.decode(ids, skip_special_tokens=True))
        try:
            call = find_call(text)
            obs = observation(evaluate(call.expression)) if call is not None else ""
        except CalcError:
            call, obs = None, ""
        texts.append(text + obs)
        final_prompt = [*prompts[i], *ids, *tokenizer.encode(obs, add_special_tokens=False)]
        # A final turn needs room for a 4-digit answer and <eos>: the driver ends an episode that has
        # none left with finish reason "context" (no answer, score 0).
        if call is not None and len(final_prompt) + ANSWER_TOKENS <= context:
            second.append((i, final_prompt))
    if second:
        room = context - max(len(p) for _, p in second)
        finals = sampler.sample_groups([p for _, p in second], 1, dataclasses.replace(
            params, max_new_tokens=min(TURN_TOKENS, room)))
        for (i, _), group in zip(second, finals, strict=True):
            texts[i] += str(tokenizer.decode(group[0].completion_ids, skip_special_tokens=True))
    return texts


def greedy_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, tasks: Sequence[CalculatorTask]) -> float:
    """Fraction of ``tasks`` whose greedy episode's final answer is the sum (the calculator verifier's score)."""
    if not tasks:
        return 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        texts = play_greedy(model, tokenizer, tasks)
    model.train(was_training)
    return sum(score(t.answer, text) for t, text in zip(tasks, texts, strict=True)) / len(tasks)


def _warm_start(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, *, seed: int, target: float,
                max_steps: int, log: Log) -> tuple[int, float]:
    """Supervised steps on transcripts until the held-out accuracy reaches ``target``; (steps, accuracy)."""
    heldout = make_split("heldout", HELDOUT_EVAL_SIZE, HELDOUT_EVAL_SEED)
    pool = make_split("train", TRAIN_POOL_SIZE, seed)
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=ADAM_BETAS, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    accuracy = greedy_accuracy(model, tokenizer, heldout)
    step = cursor = 0
    while accuracy < target and step < max_steps:
        model.train()
        if cursor + BATCH_SIZE > len(order):
            cursor = 0
        batch = [pool[i] for i in order[cursor: cursor + BATCH_SIZE]]
        cursor += BATCH_SIZE
        ids, targets = training_batch(transcript_rows(tokenizer, batch), int(tokenizer.pad_token_id))
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        if not math.isfinite(loss.item()):
            raise ModelInitError(f"calculator warm start diverged at step {step} (loss {loss.item()}): "
                                 "lower LEARNING_RATE")
        if loss.item() < COPYING_LOSS:
            every = 1
        else:
            every = EVAL_EVERY_NEAR_TARGET if accuracy >= target / 2 else EVAL_EVERY
        if step % every == 0 or step == max_steps:
            accuracy = greedy_accuracy(model, tokenizer, heldout)
            log(f"calculator warm-start step {step} loss {loss.item():.4f} heldout_accuracy {accuracy:.3f}")
    model.eval()
    return step, accuracy


def init_calculator_model(out_dir: Path | str, *, seed: int = 0, warm_start_target: float = DEFAULT_TARGET,
                          max_warm_steps: int = 2000, threads: int = 1, overwrite: bool = False,
                          log: Log = print) -> dict[str, Any]:
    """Create the calculator policy folder at ``out_dir``; returns its ``rlbus_model.json``.  Written
    next to ``out_dir`` and renamed into place, so a crash never leaves a half-written model."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ModelInitError(f"{out} exists and is not empty: pass overwrite=True or choose another --out")
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tokenizer = build_char_tokenizer()
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(tiny_config(tokenizer))
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, max_new_tokens=TURN_TOKENS)
        steps, accuracy = _warm_start(model, tokenizer, seed=seed, target=warm_start_target,
                                      max_steps=max_warm_steps, log=log)
    finally:
        torch.set_num_threads(previous_threads)
    info: dict[str, Any] = {
        "task": TASK, "seed": seed, "warm_start_steps": steps, "heldout_accuracy": accuracy,
        "warm_start_target": warm_start_target, "heldout_eval_size": HELDOUT_EVAL_SIZE,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - started, 3),
    }
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / MODEL_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    install_folder(staging, out)
    if accuracy < warm_start_target:
        log(f"calculator warm start stopped at max_warm_steps={max_warm_steps} below the target "
            f"({accuracy:.3f} < {warm_start_target}): raise max_warm_steps for a stronger start")
    log(f"saved {out} ({info['parameters']} parameters, {steps} steps, heldout_accuracy {accuracy:.3f}, "
        f"{info['seconds']} s)")
    return info
