"""The vLLM backend on a real pretrained model with tied embeddings (SmolLM2-135M-Instruct, Llama).

vLLM on CPU keeps an output layer of its own for a tied model: a weight update that names only the
embedding leaves the old output layer in place, silently.  The backend expects ``lm_head.weight`` and
adds it when a payload leaves it out, so either payload reaches the new output layer; log-probs are
compared with a transformers recompute on the new weights (float32: ~1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.model]


def test_a_weight_update_reaches_the_tied_output_layer(smollm2_model: Path) -> None:
    from rlbus.services.generator.vllm_backend import TIED_OUTPUT, VllmBackend
    from rlbus.services.policy.load import load_policy
    from rlbus.services.policy.logprobs import completion_logprobs
    from rlbus.services.policy.sampling import SamplingParams

    torch.set_num_threads(1)
    model, tok = load_policy(smollm2_model)
    backend = VllmBackend(str(smollm2_model), dtype="float32")
    try:
        assert backend.tied and TIED_OUTPUT in backend.expected
        text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                       tokenize=False)
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)

        def gap(seed: int) -> float:
            out = backend.sample([prompt], 2, params, [tok.eos_token_id], seed)[0][0]
            ref = completion_logprobs(model, [(prompt, out.completion_ids)], params)[0]
            return float((torch.from_numpy(out.behaviour_logprobs) - ref).abs().max())

        assert gap(1) < 1e-3
        for version, drop_output in ((1, True), (2, False)):
            with torch.no_grad():
                model.model.embed_tokens.weight.mul_(1.5)  # tied: the output layer moves with it
            state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
            if drop_output:
                state.pop(TIED_OUTPUT)  # a payload saved the way save_pretrained saves a tied model
            backend.stage(version, save(state))
            assert backend.version == version
            assert gap(version + 1) < 1e-3, f"version {version}: the output layer did not follow the update"
    finally:
        backend.close()
