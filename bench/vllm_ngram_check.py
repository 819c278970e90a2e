"""Is this vLLM build's n-gram drafting exact?  The check behind `NGRAM_EXACT`
(services/generator/vllm_backend.py), which refuses [generator.speculative] drafter = "group" on
the vllm backend where it is not.

Starts the vllm backend with n-gram drafting forced on, samples each prompt alone (so every
decode step may draft) greedily and at T = 1 and T = 0.7 / top-p 0.9, and compares with the
trainer's side: greedy ids against the PyTorch sampler's greedy ids, and every sampled token's
behaviour log-prob against the trainer's recompute (`completion_logprobs`).  A row is "off" when a
log-prob is not finite or differs by more than 1e-3 (vLLM and the trainer agree to ~1e-6 without
drafting, tests/vllm/test_vllm_backend.py).  Prints one JSON object, and writes it to ``--out``
when given (vLLM's engine process logs to the same stdout, so a file is what a script should read).

    .venv/bin/python bench/vllm_ngram_check.py --model models/tiny-addition [--out check.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a policy folder (rlbus init-model --out DIR builds one)")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", default="", help="also write the JSON report to this file")
    args = parser.parse_args()

    import rlbus.services.generator.vllm_backend as vb
    from rlbus.services.generator.backend import BACKENDS
    from rlbus.services.policy.load import load_policy
    from rlbus.services.policy.logprobs import completion_logprobs
    from rlbus.services.policy.sampler import GroupSampler, StaticSlot
    from rlbus.services.policy.sampling import SamplingParams
    from rlbus.services.policy.tokenizer import encode_prompt
    from rlbus.services.tasks.addition import make_split

    torch.set_num_threads(1)
    setting = vb.NGRAM_EXACT  # what the backend decides for this build, reported beside the measurement
    vb.NGRAM_EXACT = True  # a measurement: let the backend start what it would refuse
    model, tokenizer = load_policy(args.model, dtype="float32")
    prompts = [encode_prompt(tokenizer, t.prompt) for t in make_split("heldout", args.prompts, 5)]
    eos = [tokenizer.eos_token_id]
    backend = BACKENDS.create("vllm", model_path=args.model, dtype=args.dtype, deterministic=False, slowdown=1.0,
                              vllm={"threads": 1, "kv_cache_gib": 1},
                              speculative={"drafter": "group", "tail_rows": 2, "max_k": args.k})
    report: dict[str, Any] = {"vllm": "==".join(vb.installed_vllm() or ("none", "")),
                              "ngram_exact_setting": setting}
    try:
        greedy = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=8)
        ours = [backend.sample([p], 1, greedy, eos, seed=0)[0][0].completion_ids for p in prompts]
        plain = GroupSampler(StaticSlot(model)).sample_groups(prompts, 1, SamplingParams(
            temperature=0.0, max_new_tokens=8, stop_token_ids=tuple(eos)))
        report["greedy_equal"] = sum(a == g[0].completion_ids for a, g in zip(ours, plain, strict=True))
        report["greedy_rows"] = len(prompts)
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
            sampling = SimpleNamespace(temperature=temperature, top_p=top_p, max_new_tokens=8)
            off, diffs, nonfinite, rows, examples = 0, [], 0, 0, []
            for p in prompts:
                for s in backend.sample([p], 2, sampling, eos, seed=3)[0]:
                    ref = completion_logprobs(model, [(p, s.completion_ids)], SamplingParams(
                        temperature=temperature, top_p=top_p))[0].numpy()
                    got = np.asarray(s.behaviour_logprobs, dtype=np.float64)
                    finite = np.isfinite(got) & np.isfinite(ref)
                    nonfinite += int((~finite).sum())
                    diffs.extend(np.abs(got[finite] - ref[finite]).tolist())
                    rows += 1
                    if not finite.all() or (finite.any() and np.abs(got[finite] - ref[finite]).max() > 1e-3):
                        off += 1
                        if len(examples) < 3:
                            examples.append(str(tokenizer.decode(s.completion_ids)))
            report[f"T{temperature}_top_p{top_p}"] = {
                "rows": rows, "rows_off": off, "nonfinite_logprobs": nonfinite,
                "abs_diff_mean": float(np.mean(diffs)) if diffs else 0.0,
                "abs_diff_max": float(np.max(diffs)) if diffs else 0.0, "examples": examples}
        c = backend.counters
        report["drafts"], report["draft_tokens"], report["accepted_tokens"] = c.drafts, c.draft_tokens, c.accepted_tokens
    finally:
        backend.close()
    report["exact"] = report["greedy_equal"] == report["greedy_rows"] and all(
        v["rows_off"] == 0 for k, v in report.items() if k.startswith("T"))
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
