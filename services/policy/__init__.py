"""Model code shared by the generator and the trainer (they never import each other).

Modules: `tokenizer` (character tokenizer), `model_init` (tiny warm-started Qwen2),
`load` (folders and in-place weight swaps), `sampling` (the sampled distribution),
`logprobs` (full-forward recompute, batch-invariant mode), `sampler` (group sampling with
per-token weight versions). Import submodules directly; this file stays import-light so
`rlbus --help` does not pay for torch.
"""
