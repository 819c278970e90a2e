"""The real-model job, shortened to fit CI: `rlbus up` post-trains SmolLM2-135M-Instruct (a pretrained
Llama with a BPE tokenizer, a chat template and tied embeddings) on reasoning-gym's chain_sum through
every service.  It asserts what must hold at any length, not learning (the learning curve is a
benchmark: bench/real_model.py, docs/real-model.md): weights swapped in at increasing versions, the
mismatch metrics finite every step, the staleness bound, every consumed group in the ledger with an
outcome, held-out rounds at their pinned versions, and a final policy that loads with its template."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.harness import checkpoint_state, run_up

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.model]

STEPS = 4


def test_rlbus_up_post_trains_smollm2_on_chain_sum(smollm2_model: Path, tmp_path: Path) -> None:
    run_dir, rows = run_up(tmp_path, f"""
[run]
run = "real"
model_path = "{smollm2_model}"
group_size = 4
batch_groups = 4

[up]
task = "reasoning-gym:chain_sum"
train_tasks = 96
eval_tasks = 8
max_steps = {STEPS}

[controller]
eval_every = 2

[trainer]
checkpoint_every = 2
""", timeout=800)  # under the suite-wide 900 s pytest timeout; measured 183 s beside another run
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["version"] for r in train] == list(range(1, STEPS + 1)), [r["version"] for r in train]
    for r in train:
        mismatch = {k: v for k, v in r.items() if k.startswith(("mismatch/", "mismatch_fresh/"))}
        assert mismatch and all(math.isfinite(v) for v in mismatch.values()), (r["step"], mismatch)
        assert math.isfinite(r["train/step_s"]) and r["batch/rollouts_trained"] > 0
        assert r["staleness/max"] <= 2  # the run's max_staleness
    assert evals and all(e["pinned"] and e["versions"] == [e["eval_round"]] for e in evals), evals
    assert all(0.0 <= e["heldout/accuracy"] <= 1.0 for e in evals)

    # The generator staged every new version it was sent, each later than the one before.
    staged = [json.loads(line)["version"] for line in (run_dir / "logs" / "generator-0.log").read_text().splitlines()
              if '"weights_staged"' in line]
    assert staged and staged == sorted(set(staged)) and staged[-1] >= STEPS - 1, staged

    # Every group the trainer consumed has an outcome in its ledger, and the counters agree with it.
    state = checkpoint_state(run_dir)
    assert state["step"] == STEPS
    ledger = Counter(state["consumed"].values())
    assert all(isinstance(outcome, str) and outcome for outcome in ledger), ledger  # "train" or why not
    assert state["counters"]["groups_trained_total"] == ledger["train"] >= STEPS * 4, (ledger, state["counters"])

    # The final policy is a Hugging Face folder with the model's chat template, the prompt format it learned.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run_dir / "final_policy"
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template and tok.apply_chat_template([{"role": "user", "content": "1 + 1 ="}],
                                                         add_generation_prompt=True, tokenize=False).count(
        "<|im_start|>assistant") == 1
    model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    assert model.config.tie_word_embeddings and model.config.model_type == "llama"
    assert (run_dir / "report.png").stat().st_size > 10_000
