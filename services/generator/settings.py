"""Settings of the generator service ([generator] table)."""

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlbus.services.policy.drafter_names import MODEL_DRAFTERS, DrafterName
from rlbus.services.runtime.config import Settings


class VllmOptions(Settings):
    """The vLLM backend's own knobs ([generator.vllm] table); ignored by the torch backend."""

    threads: int = Field(1, ge=1, le=256, description="OpenMP threads of vLLM's model worker process (CPU builds).")
    kv_cache_gib: int = Field(1, ge=1, le=1024, description="KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE on CPU builds).")
    block_size: int | None = Field(None, ge=1, description="KV block size in tokens; prefix caching shares only whole "
                                   "blocks (None = vLLM's default: 128 on CPU, where it must be a multiple of 32).")
    compile: bool = Field(False, description="torch.compile the model (slow start on CPU; False = eager).")


class SpeculativeOptions(Settings):
    """Speculative decoding in the tail of each sampler call ([generator.speculative] table).  With
    backend = "vllm" only "group" and "off": "group" is then vLLM's n-gram drafter
    (services/generator/vllm_backend.py vllm_speculative_config).

    Off by default: on the addition task's run shape (groups of 8, 32 groups a batch, answers of
    at most 6 tokens) the rows of a batch finish within a step or two of each other, so there is
    almost no tail to draft in (bench/speculative_tail.py,
    docs/measurements/speculative-tail-cpu2-2026-12-05.md)."""

    drafter: DrafterName = Field(
        "off", description="'group': the last rows of a batch draft from their group's siblings and recent "
        "completions and are verified by the policy (exact: the samples' distribution is unchanged); 'model': a small "
        "draft model (draft_model_path) samples the drafts, and new draft versions are swapped in between target "
        "forwards; 'static': the same draft frozen at its first version; 'model+group' / 'static+group': per row "
        "per round the group's suffix match where there is one, else that draft model's sample; 'off': plain decoding.")
    tail_rows: int = Field(2, ge=1, le=1024, description="Drafting starts once this many rows or fewer are still "
                           "decoding (measured crossover on a CPU: drafting pays at 1-2 rows, not from 4).")
    max_k: int = Field(4, ge=1, le=16, description="Most tokens drafted per row per verify forward (the draft "
                       "length adapts below it to the measured acceptance and the rows left).")
    draft_model_path: str = Field("", description="drafter 'model', 'static', 'model+group', 'static+group': the "
                                  "draft model's Hugging Face folder "
                                  "(services/policy/draft_model.py build_draft + save_draft): the policy's tokenizer, "
                                  "vocabulary and context, fewer layers.  Checked against the policy at start-up.")

    @model_validator(mode="after")
    def _draft_needs_a_path(self) -> "SpeculativeOptions":
        if self.drafter in MODEL_DRAFTERS and not self.draft_model_path:
            raise ValueError(
                f"drafter = {self.drafter!r} needs draft_model_path, the draft model's folder: build one with "
                "rlbus.services.policy.draft_model.build_draft and save_draft, or set drafter = \"group\" or \"off\"")
        if self.drafter in MODEL_DRAFTERS and not (Path(self.draft_model_path) / "config.json").is_file():
            raise ValueError(
                f"draft_model_path = {self.draft_model_path!r} is not a model folder (no config.json): point it at a "
                "folder written by rlbus.services.policy.draft_model.save_draft")
        return self


class ChatEndpointOptions(Settings):
    """The OpenAI-compatible chat endpoint ([generator.openai] table; used when openai_port > 0)."""

    host: str = Field("127.0.0.1", description="Address the endpoint listens on (0.0.0.0 to serve other hosts).")
    model: str = Field("", description="Model name clients must send ('' = the run's model_name).")
    pool: str = Field("", description="Pool of an episode whose request names none ('' = the run's first pool).")
    env: str = Field("chat", description="Environment name of an episode whose request names none (selects its "
                     "verifier unless x-rlbus-verifier or a reported reward does).")
    max_tokens: int = Field(256, ge=1, description="Tokens a request may sample when it sets no max_tokens.")
    group_timeout_s: float = Field(60.0, gt=0, description="A task's group still short of group_size this long after "
                                   "its first episode ended is published with the episodes that ended (two or more).")
    episode_ttl_s: float = Field(600.0, gt=0, description="An episode with no request for this long is abandoned "
                                 "(dropped, never published).")


class GeneratorSettings(Settings):
    instance: str = Field("gen-0", description="Instance name: control and metrics subject token; unique per replica.")
    backend: Literal["torch", "vllm"] = Field("torch", description="Sampling engine behind the backend interface.")
    pools: list[str] = Field(default_factory=list, description="Pools to pull tasks from ([] = the run's train pools + eval pool).")
    max_batch_groups: int = Field(32, ge=1, le=1024, description="Most groups sampled together in one batch.")
    min_batch_groups: int = Field(16, ge=1, le=1024, description="While the admission grant leaves room for fewer "
                                  "groups than this, wait up to batch_wait_s for it to grow (fewer, fuller batches).")
    batch_wait_s: float = Field(0.2, ge=0, description="Longest wait for a small grant to grow (0 = never wait).")
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads (1 is fastest for small models on small machines).")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Sampling precision (bfloat16 injects a known mismatch).")
    deterministic: bool = Field(False, description="Batch-invariant logprobs, bit-identical to the trainer's.")
    admission: bool = Field(True, description="Start groups only within the controller's grant (bounded staleness).")
    mid_sequence_swap: Literal["next_step", "when_cheaper"] = Field(
        "when_cheaper", description="torch backend: when new weights arrive mid-batch, 'next_step' swaps at the next "
        "decode step (rebuilding in-flight rows' KV under the new weights); 'when_cheaper' does so only while the "
        "tokens left to decode outnumber the prefix to rebuild, else the batch finishes on its weights.  (The "
        "episode engine swaps between its runs of 8 decode steps, rebuilding its rows' KV.)")
    single_turn: Literal["batch", "episodes"] = Field(
        "episodes", description="torch backend: where single-turn training tasks are sampled: 'episodes' on the "
        "episode engine as one-turn episodes (continuous batching: a finished group's room is refilled at once); "
        "'batch' in batch-synchronous calls (a batch waits for its slowest row).  Held-out tasks stay on the batch "
        "path, which samples them on their round's pinned weights, and so do all single-turn tasks while a "
        "[generator.speculative] drafter is on (the speculative tail is the batch sampler's), and in deterministic "
        "mode unless single_turn is set (the batch sampler decodes the trainer's exact log-probs, the episode engine "
        "recomputes them); the vLLM backend batches continuously inside its own calls either way.  See "
        "docs/environments.md.")
    eval_weights: Literal["pinned", "live"] = Field(
        "pinned", description="Held-out rounds: 'pinned' samples each round at exactly the version it was scheduled "
        "at, on a second copy of the model (torch backend; twice the weight memory); 'live' samples on the moving "
        "live weights and records which versions produced the tokens (the vLLM backend always does this).")
    seed: int = Field(0, description="Sampling seed (combined with the instance name).")
    env_timeout: float = Field(10.0, gt=0, description="Seconds to wait for an environment reply.")
    slowdown: float = Field(1.0, ge=1.0, description="Testing aid: multiply sampling time (simulates a slow accelerator).")
    slowdown_file: str = Field("", description="Testing aid: a file holding a slowdown factor, re-read between batches "
                               "so a test can slow a running generator and speed it up again ('' = off).")
    openai_port: int = Field(0, ge=0, le=65535, description="Port of the OpenAI-compatible /v1/chat/completions "
                             "endpoint for unmodified agents (0 = off); see docs/chat-endpoint.md.")
    openai: ChatEndpointOptions = Field(default_factory=ChatEndpointOptions, description="Chat endpoint options.")
    vllm: VllmOptions = Field(default_factory=VllmOptions, description="vLLM backend options (threads, KV cache, blocks).")
    speculative: SpeculativeOptions = Field(default_factory=SpeculativeOptions, description=(
        "Speculative decoding of the batch's tail: drafter, tail_rows, max_k (vllm backend: 'group' as vLLM's "
        "n-gram drafter, or 'off')."))

    @property
    def single_turn_episodes(self) -> bool:
        """Whether single-turn training tasks play on the episode engine (see `single_turn`)."""
        if self.backend != "torch" or self.speculative.drafter != "off":
            return False
        if self.deterministic and "single_turn" not in self.model_fields_set:
            # Measured (bench/pipeline_bench.py --run 100, deterministic on both sides): 0.32 s per
            # step on the batch path, 0.38 on the episode engine, whose recompute the batch path's
            # exact decode does not need (default mode: 0.36).
            return False
        return self.single_turn == "episodes"

    @model_validator(mode="after")
    def _speculation_needs_torch(self) -> "GeneratorSettings":
        if self.backend == "vllm" and self.speculative.drafter not in ("off", "group"):
            raise ValueError(
                f"[generator.speculative] drafter = {self.speculative.drafter!r} needs backend = \"torch\" (its draft "
                "model is swapped in at run time by rlbus's own sampler); with backend = \"vllm\" use drafter = "
                "\"group\" (vLLM's n-gram drafting: each request's own prompt and output) or \"off\"")
        if self.speculative.drafter != "off" and self.single_turn == "episodes" and "single_turn" in self.model_fields_set:
            raise ValueError(
                f"[generator] single_turn = \"episodes\" with [generator.speculative] drafter = "
                f"{self.speculative.drafter!r}: the speculative tail drafts inside the batch sampler only, so set "
                "single_turn = \"batch\" (what a drafter uses when single_turn is not set) or drafter = \"off\"")
        return self
