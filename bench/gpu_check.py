"""GPU check of the vLLM backend: tokens/s, weight-update pause, and the gap to the trainer, as JSON.

Run by ``bench/gpu_check.sh`` on a machine with an NVIDIA GPU (it installs what this needs), with a
model built from config (``rlbus init-model``, or any Hugging Face causal-LM folder), in the
precision given:

- throughput: ``bench.backend_throughput.measure`` on the vLLM backend (prompts x samples x tokens);
- weight update: a re-initialised policy staged while a long group is sampled; pause seconds and
  the share of sequences whose tokens span both versions;
- mismatch: behaviour logprobs of a group against the trainer's recompute (``completion_logprobs``
  on the same device and weights): mean/max |Δ| and k3 KL.

    python -m bench.gpu_check --model models/tiny-addition --dtype bfloat16 --out gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-addition")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from safetensors.torch import save
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.backend_throughput import measure, workload
    from rlbus.services.generator.backend import BACKENDS
    from rlbus.services.policy.load import load_policy
    from rlbus.services.policy.logprobs import completion_logprobs
    from rlbus.services.policy.sampling import SamplingParams
    from rlbus.services.trainer.mismatch import mismatch_metrics

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, Any] = {"bench": "gpu_check", "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                           "torch": torch.__version__, "dtype": args.dtype, "model": args.model}
    backend = BACKENDS.create("vllm", model_path=args.model, dtype=args.dtype, deterministic=False, slowdown=1.0)
    try:
        import vllm

        out["vllm"] = vllm.__version__
        prompts = workload(backend.tokenizer, args.prompts)
        out["throughput"] = measure(backend, prompts, args.samples, args.tokens, reps=3)

        # Mismatch against the trainer's recompute, same weights, same device.
        model, tokenizer = load_policy(args.model, dtype=args.dtype)
        model.to(device)
        sampling = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=16)
        groups = backend.sample(prompts[:32], 8, sampling, [tokenizer.eos_token_id], seed=1)
        pairs = [(p, s.completion_ids) for p, g in zip(prompts[:32], groups, strict=True) for s in g]
        behaviour = [torch.as_tensor(s.behaviour_logprobs) for g in groups for s in g]
        with torch.no_grad():
            trainer = [t.float().cpu() for t in completion_logprobs(model, pairs, SamplingParams(temperature=1.0))]
        seq = torch.cat([torch.full((len(b),), i) for i, b in enumerate(behaviour)])
        m = mismatch_metrics(torch.cat(trainer), torch.cat(behaviour), torch.ones(len(seq), dtype=torch.bool), seq,
                             is_low=0.5, is_high=2.0)
        out["mismatch"] = {k: float(v) for k, v in m.items() if k.startswith("mismatch/")}

        # A weight update while a long group is in flight.
        torch.manual_seed(1)
        other = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=getattr(torch, args.dtype))
        payload = save({k: v.contiguous() for k, v in other.state_dict().items()})
        long = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=256)
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(backend.sample(prompts[:32], 8, long, [], seed=2)))
        t.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        backend.stage(1, payload)
        staged_s = time.perf_counter() - t0
        t.join()
        seqs = [s for g in result[0] for s in g]
        spanning = sum(1 for s in seqs if len(set(np.asarray(s.token_versions).tolist())) > 1)
        metrics = backend.metrics()
        out["weight_update"] = {"stage_call_s": staged_s, "pause_s": metrics.get("generator/swap_pause_last_s"),
                                "sequences": len(seqs), "spanning_both_versions": spanning,
                                "payload_mb": len(payload) / 2**20}
        out["backend_metrics"] = metrics
    finally:
        backend.close()
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
