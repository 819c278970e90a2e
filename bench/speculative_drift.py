"""Drafters under a drifting policy: no drafting, a static draft, an online draft, the group
drafter, the online draft and the group drafter combined, before and after a scripted policy
shift half way through the stream (docs/measurements/speculative-drift-cpu2-2026-12-06.md and
speculative-drift-cpu2-2026-12-07.md hold its results).

Policy: the tests' tiny addition model with <eos> switched off (as bench/speculative.py), so every
completion runs `--max-new-tokens`: 55 by default, the most its 64-position context allows after
the 9-token prompts (long completions, >= 64 tokens, are the shape drafting is for; this model
cannot hold that). v0 answers, then writes mostly <eos> ids with a scattered digit. v1 = v0 after
`--drift-steps` optimiser steps of supervised training on v0's own completions whose post-answer
tokens are replaced by a count (the digit after the answer's last digit, then the next, mod 10);
only those post-answer tokens carry loss, meant to move what comes after the answer, as an RL
update moves the distribution where the reward does not pin it (measured: the answer moves too,
the layers being shared). The report says how far it moved: mean KL(v1 || v0) per token within the
first 4 completion tokens (v0's answer and its <eos>) and after them, on v1's samples of the
stream's prompts; the static draft's acceptance before vs after the shift says it too.

Stream: `--batches` held-out prompts, one batch each; the first half is sampled from v0, the
second from v1 (the shift). Every batch, every mode (interleaved, so load drifts hit all alike):
  overall  the prompt's group of 8 decoded together, drafting allowed at all 8 rows (tail_rows 8)
           under the adaptive draft length, which switches drafting off where it does not pay:
           with <eos> off the rows end together, so this is the whole call;
  tail     one row of the prompt from its first token, its 7 siblings (sampled beforehand from
           the phase's policy) in the drafter's pool: the last 1/8 = 12.5% of the group's rows,
           the nearest a group of 8 comes to "the last 10% of sequences".
Modes: off; static (a `--draft-layers` draft distilled on v0's samples before the run, then
frozen); online (the same start, then `--online-steps` DraftDistiller steps after each batch on a
window of the stream's latest `--online-window` samples, the overall calls' own rows; each new
version staged into the tail's WeightSlot and swapped in before the next drafting round, as
weight-broadcast would deliver it; in the real system the `speculator` role runs these steps off
the generator, so their time is reported apart and not in wall); group; online_group (drafter
"model+group" on the same online slot: per row per round the group's suffix match where it has
one, else the online draft's sample; its group_/model_acceptance_rate say which half pays); the
two drafts at fixed k; an A/A control (MODES says why).

Prints ONE JSON object: per phase (before / after the shift, and `after_late`, its second half,
once the online draft has caught up) and shape, per mode, medians over `--repeats` replays of the
whole stream (each from the same start) of tokens per wall second, speedup over off measured in
the same replays, and (drafting modes) acceptance rate and tokens per row per target forward
summed over the replays. One torch thread.

  nice -n 19 .venv/bin/python bench/speculative_drift.py
  nice -n 19 .venv/bin/python bench/speculative_drift.py --batches 16 --repeats 2 --online-steps 2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.speculative import distilled_draft, draft_options  # noqa: E402
from bench.speculative_accept import _model  # noqa: E402
from rlbus.services.policy.distill import DraftDistiller, PolicySample  # noqa: E402
from rlbus.services.policy.sampler import GroupSampler, StaticSlot  # noqa: E402
from rlbus.services.policy.sampling import SamplingParams  # noqa: E402
from rlbus.services.policy.spec_tail import FixedDraftLength, Speculation, SpeculationConfig, TailStats  # noqa: E402
from rlbus.services.policy.tokenizer import encode_prompt  # noqa: E402
from rlbus.services.policy.weight_slot import WeightSlot  # noqa: E402
from rlbus.services.tasks.addition import make_split  # noqa: E402

# *_fixed_k: the draft models at k = max_k every round, what they accept whatever they cost (the
# adaptive rule switches a draft off where its cost outweighs its gain, leaving nothing to compare).
# off_again: no drafting a second time, last in each batch: its "speedup" over off is the timing
# noise of this machine under its load (an A/A control), the band any other speedup must clear.
MODES = ("off", "static", "online", "group", "online_group", "static_fixed_k", "online_fixed_k", "off_again")
ANSWER_SPAN = 4  # the longest addition answer here (3 digits) and its <eos>
SHAPES = {"overall": (8, 8), "tail": (1, 1)}  # shape -> (rows per call, tail_rows)


def answer_end(completion: Sequence[int], eos_id: int) -> int:
    """How many tokens the answer takes, its closing <eos> included (all of it when none)."""
    for i, t in enumerate(completion):
        if t == eos_id:
            return i + 1
    return len(completion)


def drift_target(completion: Sequence[int], eos_id: int, digit_ids: Sequence[int]) -> PolicySample | None:
    """v0's completion with its post-answer tokens replaced by a count from the answer's last digit;
    loss on those tokens only; None when there is no answer digit or nothing after the answer."""
    end = answer_end(completion, eos_id)
    digits = [digit_ids.index(t) for t in completion[:end] if t in digit_ids]
    if not digits or end >= len(completion):
        return None
    tail = [digit_ids[(digits[-1] + 1 + j) % 10] for j in range(len(completion) - end)]
    return PolicySample([], list(completion[:end]) + tail, [0] * end + [1] * len(tail))


def drifted_policy(v0: Any, prompts: list[list[int]], samples: list[list[int]], eos_id: int,
                   digit_ids: list[int], args: argparse.Namespace) -> tuple[Any, dict]:
    """v1: a copy of v0 after `--drift-steps` supervised steps towards the counting continuation.
    DraftDistiller is reused as the optimiser: its step is exactly loss-masked cross-entropy at T."""
    pairs = [(p, drift_target(c, eos_id, digit_ids)) for p, c in zip(prompts, samples, strict=True)]
    targets = [PolicySample(p, t.completion, t.loss_mask) for p, t in pairs if t is not None]
    v1 = copy.deepcopy(v0)
    t0 = time.perf_counter()
    losses = DraftDistiller(v1, temperature=1.0, lr=args.drift_lr).fit(targets, args.drift_steps, seed=args.seed + 7)
    return v1.eval(), {"steps": args.drift_steps, "lr": args.drift_lr, "sequences": len(targets),
                       "train_s": round(time.perf_counter() - t0, 2), "loss_first": round(losses[0], 3),
                       "loss_last": round(losses[-1], 3)}


def mean_kl(logp: torch.Tensor, logq: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over positions where `mask` is true of KL(p || q), from log-probabilities [..., V]."""
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return float(kl[mask].mean()) if bool(mask.any()) else 0.0


def drift_distance(v0: Any, v1: Any, prompts: list[list[int]], samples: list[list[int]],
                   temperature: float) -> dict[str, float]:
    """KL(v1 || v0) per completion token at the sampling temperature, on v1's samples, over the
    first ANSWER_SPAN tokens (where v0 puts its answer and closing <eos>) and the rest. v1's own
    samples carry no reliable answer boundary (it may count on without an <eos>), hence a span."""
    out: dict[str, list[float]] = {"answer_span": [], "after": []}
    with torch.no_grad():
        for p, c in zip(prompts, samples, strict=True):
            ids = torch.tensor([list(p) + list(c)])
            lp1 = torch.log_softmax(v1(input_ids=ids).logits[0].float() / temperature, -1)
            lp0 = torch.log_softmax(v0(input_ids=ids).logits[0].float() / temperature, -1)
            # Position j predicts token j + 1: completion token i is predicted at len(p) + i - 1.
            rows = torch.arange(len(p) - 1, len(p) - 1 + len(c))
            after = torch.arange(len(c)) >= ANSWER_SPAN
            out["answer_span"].append(mean_kl(lp1[rows], lp0[rows], ~after))
            out["after"].append(mean_kl(lp1[rows], lp0[rows], after))
    return {f"kl_v1_v0_{k}": round(statistics.mean(v), 3) for k, v in out.items()}


def phase_of(batch: int, batches: int) -> str:
    """The stream's phase of a batch: v0 for the first half, v1 (after the shift) for the rest."""
    return "before" if batch < batches // 2 else "after"


def phases_of(batch: int, batches: int) -> list[str]:
    """Every phase a batch is reported under: its half, and `after_late` for the last quarter."""
    return [phase_of(batch, batches)] + (["after_late"] if batch >= batches - batches // 4 else [])


class OnlineDraft:
    """The online draft: the speculator's trainer copy, distilled on the stream after each batch,
    and the generator's draft slot, into which each new version is staged (not pausing sampling)."""

    def __init__(self, start: Any, temperature: float, args: argparse.Namespace) -> None:
        self.trainer = copy.deepcopy(start)
        self.slot = WeightSlot(copy.deepcopy(start).eval(), 0)
        self.distiller = DraftDistiller(self.trainer, temperature=temperature, lr=args.online_lr)
        self.steps, self.window_size, self.seed = args.online_steps, args.online_window, args.seed
        self.window: list[PolicySample] = []
        self.version = 0
        self.distill_s = 0.0

    def learn(self, samples: list[PolicySample]) -> None:
        """`steps` distillation steps on the latest window of the stream, then stage the new version."""
        self.window = (self.window + samples)[-self.window_size:]
        if self.steps == 0:
            return
        t0 = time.perf_counter()
        self.distiller.fit(self.window, self.steps, seed=self.seed + self.version)
        self.version += 1
        # Clone: the trainer keeps stepping, the staged version must stay the one just made.
        self.slot.stage(self.version, {k: v.detach().clone() for k, v in self.trainer.state_dict().items()})
        self.distill_s += time.perf_counter() - t0


@dataclass
class Tally:
    """One mode's calls of one shape in one phase of one replay."""

    wall_s: float = 0.0
    tokens: int = 0
    stats: TailStats = field(default_factory=TailStats)


@dataclass
class Stream:
    """What every replay decodes: the prompts, the policy of each phase, each batch's siblings."""

    prompts: list[list[int]]
    policies: dict[str, Any]
    siblings: list[list[list[int]]]
    params: SamplingParams
    static: Any
    distilled: Any


def speculations(stream: Stream, online: OnlineDraft, max_k: int) -> dict[str, dict[str, Speculation | None]]:
    """Fresh speculative tails per mode and shape; every online tail shares the one online slot."""
    out: dict[str, dict[str, Speculation | None]] = {}
    for mode in MODES:
        out[mode] = {}
        fixed = FixedDraftLength(max_k) if mode.endswith("_fixed_k") else None
        for shape, (_, tail_rows) in SHAPES.items():
            if mode.startswith("off"):
                out[mode][shape] = None
            elif mode == "group":
                out[mode][shape] = Speculation(SpeculationConfig(drafter="group", tail_rows=tail_rows, max_k=max_k))
            elif mode == "online_group":
                out[mode][shape] = Speculation(SpeculationConfig(drafter="model+group", tail_rows=tail_rows,
                                                                 max_k=max_k), draft=online.slot)
            elif mode.startswith("static"):
                out[mode][shape] = Speculation(SpeculationConfig(drafter="static", tail_rows=tail_rows, max_k=max_k),
                                               draft=StaticSlot(stream.static), lengths=fixed)
            else:
                out[mode][shape] = Speculation(SpeculationConfig(drafter="model", tail_rows=tail_rows, max_k=max_k),
                                               draft=online.slot, lengths=fixed)
    return out


def replay(stream: Stream, rep: int, args: argparse.Namespace) -> tuple[dict[tuple[str, str, str], Tally], float]:
    """The whole stream once, every mode per batch; tallies by (mode, phase, shape), distill seconds."""
    online = OnlineDraft(stream.distilled, stream.params.temperature, args)
    specs = speculations(stream, online, args.max_k)
    tallies: dict[tuple[str, str, str], Tally] = {}
    batches = len(stream.prompts)
    for b, prompt in enumerate(stream.prompts):
        policy = stream.policies[phase_of(b, batches)]
        fresh: list[PolicySample] = []
        for mode in MODES:
            for s, (shape, (rows, _)) in enumerate(SHAPES.items()):
                spec = specs[mode][shape]
                if spec is not None and shape == "tail":
                    for c in stream.siblings[b]:
                        spec.recent.add(c)
                gen = torch.Generator().manual_seed(rep * 100_003 + b * 7 + s)
                t0 = time.perf_counter()
                group = GroupSampler(StaticSlot(policy), speculation=spec).sample_groups(
                    [prompt], rows, stream.params, generator=gen)[0]
                wall = time.perf_counter() - t0
                for phase in phases_of(b, batches):
                    t = tallies.setdefault((mode, phase, shape), Tally())
                    t.wall_s += wall
                    t.tokens += sum(len(x.completion_ids) for x in group)
                    if spec is not None:
                        t.stats.add(spec.last_call)
                if mode == "online" and shape == "overall":
                    fresh = [PolicySample(prompt, x.completion_ids) for x in group]
        # After every mode's calls: no call drafts with a version distilled on its own batch.
        online.learn(fresh)
    return tallies, online.distill_s


def call_tokens_per_forward(tally: Tally) -> float:
    """Tokens per row per target forward over the whole calls: plain decoding yields one token per
    row-forward, the tail `stats.tokens` over `stats.row_forwards`."""
    plain = tally.tokens - tally.stats.tokens
    forwards = plain + tally.stats.row_forwards
    return tally.tokens / forwards if forwards else 0.0


def summarise(replays: list[dict[tuple[str, str, str], Tally]]) -> dict[str, Any]:
    """phase -> shape -> mode: medians over replays of tokens/s and of the speedup over off in the
    same replay; acceptance and tokens per forward over all replays together."""
    out: dict[str, Any] = {}
    keys = {(p, s) for r in replays for (_, p, s) in r}
    for phase, shape in sorted(keys):
        entry: dict[str, Any] = {}
        for mode in MODES:
            runs = [r[(mode, phase, shape)] for r in replays]
            rates = [t.tokens / t.wall_s for t in runs]
            offs = [r[("off", phase, shape)] for r in replays]
            total = Tally(tokens=sum(t.tokens for t in runs))
            for t in runs:
                total.stats.add(t.stats)
            entry[mode] = {"tokens_per_s": round(statistics.median(rates), 1),
                           "tokens_per_forward": round(call_tokens_per_forward(total), 3)}
            if mode != "off":
                entry[mode]["wall_speedup"] = round(statistics.median(
                    (t.tokens / t.wall_s) / (o.tokens / o.wall_s) for t, o in zip(runs, offs, strict=True)), 3)
            if not mode.startswith("off"):
                entry[mode]["acceptance_rate"] = round(total.stats.metrics()["acceptance_rate"], 3)
                entry[mode]["drafted_token_share"] = round(total.stats.tokens / max(1, total.tokens), 3)
            if mode == "online_group":
                metrics = total.stats.metrics()
                entry[mode].update({f"{src}_{m}": round(metrics[f"{src}_{m}"], 3)
                                    for src in ("group", "model") for m in ("acceptance_rate", "kept")})
        out.setdefault(phase, {})[shape] = entry
    return out


def targets(table: dict[str, Any]) -> dict[str, Any]:
    """The targets the drafters are judged on, read off the table: draft quality after the shift
    (tokens per forward at fixed k, and under the adaptive rule), the best drafter in the tail, the
    adaptive modes overall."""
    after = table["after"]
    adaptive = ("static", "online", "group", "online_group")
    drafters = [m for m in MODES if not m.startswith("off")]

    def ratio(phase: str, shape: str, online: str, static: str) -> float:
        entry = table[phase][shape]
        return round(entry[online]["tokens_per_forward"] / max(1e-9, entry[static]["tokens_per_forward"]), 3)

    best = {p: max(drafters, key=lambda m: table[p]["tail"][m]["wall_speedup"]) for p in ("before", "after")}
    overall_min = min(table[p]["overall"][m]["wall_speedup"] for p in ("before", "after") for m in adaptive)
    fixed = ratio("after", "tail", "online_fixed_k", "static_fixed_k")
    return {"online_over_static_tokens_per_forward": {
                f"{p}/{s}/{k}": ratio(p, s, f"online{k}", f"static{k}")
                for p in ("before", "after", "after_late") for s in SHAPES for k in ("", "_fixed_k")},
            "online_over_static_met (>= 1.25, after, tail, fixed k)": fixed >= 1.25,
            "best_tail_drafter": best,
            "best_tail_speedup": {p: table[p]["tail"][m]["wall_speedup"] for p, m in best.items()},
            "tail_speedup_met (>= 1.3, before and after)": min(
                table[p]["tail"][m]["wall_speedup"] for p, m in best.items()) >= 1.3,
            "min_overall_speedup_adaptive": overall_min, "overall_floor_met (>= 0.95)": overall_min >= 0.95,
            "after_online_tail": after["tail"]["online"],
            "a_a_control_speedups": sorted(table[p][s]["off_again"]["wall_speedup"] for p in table for s in SHAPES)}


def plain_groups(policy: Any, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[list[list[int]]]:
    """8 completions of each prompt from `policy` by plain sampling."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        groups = GroupSampler(StaticSlot(policy)).sample_groups(prompts, 8, params, generator=gen)
    return [[list(s.completion_ids) for s in g] for g in groups]


def build_stream(args: argparse.Namespace) -> tuple[Stream, dict[str, Any]]:
    """v0, v1, the drafts and the stream's prompts and siblings, and what building them measured."""
    v0, tokenizer = _model(args.model)
    v0.generation_config.eos_token_id = None  # long completions: <eos> is just another token
    v0.config.eos_token_id = None
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    eos_id = int(tokenizer.convert_tokens_to_ids("<eos>"))
    digit_ids = [int(tokenizer.convert_tokens_to_ids(str(d))) for d in range(10)]
    distilled, distill_info = distilled_draft(v0, tokenizer, params, args)
    drift_prompts = [encode_prompt(tokenizer, t.prompt) for t in make_split("train", args.drift_prompts, args.seed + 2)]
    drift_samples = plain_groups(v0, drift_prompts, params, args.seed + 2)
    v1, drift_info = drifted_policy(v0, [p for p in drift_prompts for _ in range(8)],
                                    [c for g in drift_samples for c in g], eos_id, digit_ids, args)
    prompts = [encode_prompt(tokenizer, t.prompt) for t in make_split("heldout", args.batches, args.seed)]
    half = args.batches // 2
    groups = plain_groups(v0, prompts[:half], params, args.seed + 3) + plain_groups(v1, prompts[half:], params, args.seed + 4)
    drift_info.update(drift_distance(v0, v1, [p for p in prompts[half:] for _ in range(8)],
                                     [c for g in groups[half:] for c in g], args.temperature))
    stream = Stream(prompts, {"before": v0, "after": v1}, [g[1:] for g in groups], params,
                    copy.deepcopy(distilled).eval(), distilled)
    return stream, {"distill": distill_info, "drift": drift_info, "context": v0.config.max_position_embeddings,
                    "prompt_tokens": max(len(p) for p in prompts)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    stream, info = build_stream(args)
    with torch.no_grad():
        GroupSampler(StaticSlot(stream.policies["before"])).sample_groups(stream.prompts[:1], 8, stream.params)  # warm-up
    replays, distill_s = [], []
    for rep in range(args.repeats):
        tallies, seconds = replay(stream, rep, args)
        replays.append(tallies)
        distill_s.append(seconds)
    table = summarise(replays)
    return {"model": args.model or "tests tiny model", "eos": "off", "temperature": args.temperature,
            "top_p": args.top_p, "max_new_tokens": args.max_new_tokens, "max_k": args.max_k,
            "draft_layers": args.draft_layers, "batches": args.batches, "repeats": args.repeats, **info,
            "online": {"steps_per_batch": args.online_steps, "window": args.online_window, "lr": args.online_lr,
                       "distill_s_per_replay": round(statistics.median(distill_s), 2),
                       "distill_ms_per_batch": round(statistics.median(distill_s) / args.batches * 1e3, 1)},
            "phases": table, "targets": targets(table)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    draft_options(parser)
    parser.add_argument("--batches", type=int, default=32, help="stream batches (one held-out prompt each)")
    parser.add_argument("--drift-prompts", type=int, default=32, help="train prompts (x 8 samples) v1 is trained on")
    parser.add_argument("--drift-steps", type=int, default=20)
    parser.add_argument("--drift-lr", type=float, default=1e-3)
    parser.add_argument("--online-steps", type=int, default=8, help="distillation steps per batch")
    parser.add_argument("--online-window", type=int, default=64, help="latest stream samples distilled on")
    parser.add_argument("--online-lr", type=float, default=1e-3)
    parser.add_argument("--max-new-tokens", type=int, default=55, help="the context (64) less the 9-token prompt")
    parser.add_argument("--repeats", type=int, default=3)
    print(json.dumps(run(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
