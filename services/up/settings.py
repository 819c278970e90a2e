"""Settings of ``rlbus up`` ([up] table): the model, the task set, stopping rule and process layout."""

from typing import Literal

from pydantic import Field, field_validator

from rlbus.services.runtime.config import Settings
from rlbus.services.tasks.reasoning_gym import TASK_PREFIX, ReasoningGymSettings

# A turn's token cap when [up] max_new_tokens is not set: an addition answer is at most 4 digits and
# <eos>; a calculator tool turn is `calc(` + 15 characters + `)` (services/policy/calc_init.py); a
# reasoning-gym answer read as a first number needs a few tokens, one inside <answer> tags room to reason.
TURN_TOKENS = {"addition": 6, "calculator": 24}
REASONING_TURN_TOKENS = {"first_number": 8, "last_number": 12, "full": 32, "tag": 256}
BUILT_TASKS = ("addition", "calculator")


class UpSettings(Settings):
    task: str = Field("addition", description="The learning task: 'addition' (3-digit sums, one turn), 'calculator' "
                      "(four 3-digit terms and an arithmetic tool: multi-turn episodes), or "
                      "'reasoning-gym:<dataset>' (any of reasoning-gym's datasets, e.g. reasoning-gym:chain_sum; "
                      "needs a pretrained instruct model, see model).")
    model: str = Field("", description="A pretrained policy rlbus fetches and converts on first use "
                       "('smollm2-135m-instruct', into models/<model> unless [run] model_path is set); '' = the "
                       "task's own warm-started tiny policy, built here.")
    reasoning_gym: ReasoningGymSettings = Field(default_factory=ReasoningGymSettings, description=(
        "[up.reasoning_gym]: the dataset's settings, system message, answer extraction and reward mode."))
    train_tasks: int = Field(65536, ge=1, description="Tasks of the chosen task for the train pool (published as the backlog drains).")
    epochs: int = Field(0, ge=0, description="Passes over the training tasks, each reshuffled under new task ids "
                        "(0 = as many as the run needs until max_steps or stop_at_accuracy).")
    eval_tasks: int = Field(200, ge=0, description="Held-out tasks (never trained on) evaluated every eval_every versions.")
    max_steps: int = Field(1000, ge=1, description="Stop after this many trainer steps.")
    stop_at_accuracy: float = Field(0.9, ge=0, le=1, description="Also stop once held-out accuracy reaches this (0 = run all steps).")
    # One 200-task round has ~0.035 standard error: stopping on the first reading at the target
    # stops on a lucky one (the default run's first 0.905 scored 0.864 on 2,000 other tasks).
    stop_rounds: int = Field(3, ge=1, description="Stop only when the mean of this many latest held-out rounds reaches stop_at_accuracy.")
    seed: int = Field(0, description="Seed of the model build and the task sets.")
    backend: Literal["torch", "vllm"] = Field("torch", description="Generator backend.")
    generators: int = Field(1, ge=1, le=64, description="Generator processes.")
    max_new_tokens: int = Field(0, ge=0, description="Token cap of each policy turn (0 = the task's own: 6 for "
                                "addition, 24 for calculator; for a reasoning-gym answer 8 read as the first number, "
                                "12 as the last, 256 inside <answer> tags).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of training tasks.")
    init_target: float = Field(0.30, ge=0, le=1, description="Warm-start held-out accuracy when the model is built.")
    shutdown_grace: float = Field(15.0, gt=0, description="Seconds services get to stop after SIGTERM.")

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str) -> str:
        if value in BUILT_TASKS:
            return value
        if value.startswith(TASK_PREFIX) and value[len(TASK_PREFIX):]:
            from rlbus.services.tasks.reasoning_gym import check_dataset

            check_dataset(value[len(TASK_PREFIX):])  # TaskError (a ValueError): names the 106 datasets
            return value
        raise ValueError(f"unknown task {value!r}: use 'addition', 'calculator' or 'reasoning-gym:<dataset>' "
                         "(e.g. reasoning-gym:chain_sum)")

    @property
    def dataset(self) -> str:
        """The reasoning-gym dataset of the task ('' for a built task)."""
        return self.task[len(TASK_PREFIX):] if self.task.startswith(TASK_PREFIX) else ""

    @property
    def turn_tokens(self) -> int:
        if self.max_new_tokens:
            return self.max_new_tokens
        if self.dataset:
            from rlbus.services.tasks.reasoning_gym import resolve

            return REASONING_TURN_TOKENS[resolve(self.dataset, self.reasoning_gym).extract]
        return TURN_TOKENS[self.task]


# The real-model recipe: what `rlbus up` fills in for a reasoning-gym task, under every key the run's config
# leaves unset (the resolved config.toml shows the result).  Sized for a 135M-parameter policy on a
# 2-core CPU: small batches, bf16 matmuls over float32 master weights, a learning rate for a pretrained
# model (docs/real-model.md, and the measurement file it links, say how it was chosen).
REASONING_GYM_RECIPE: dict[str, dict[str, object]] = {
    "up": {"train_tasks": 4096, "eval_tasks": 100, "max_steps": 60, "stop_at_accuracy": 0.0, "shutdown_grace": 90.0},
    "run": {"group_size": 8, "batch_groups": 8},
    # micro_batch_seqs 16 (gradient accumulation, the same step): the trainer's peak memory was 9.3 GB at 64 and
    # 9.0 GB at 16, so activations are not what fills it (docs/measurements/real-model-run-cpu2-2026-12-07.md).
    "trainer": {"lr": 1e-5, "autocast": "bfloat16", "checkpoint_every": 20, "micro_batch_seqs": 16},
    "generator": {"dtype": "bfloat16", "max_batch_groups": 8, "min_batch_groups": 4},
    "controller": {"eval_every": 10},
}


def with_recipe(data: dict[str, dict[str, object]], task: str) -> dict[str, dict[str, object]]:
    """``data`` (a run config's tables) with the recipe of ``task`` under every key it does not set."""
    if not task.startswith(TASK_PREFIX):
        return data
    out = {name: dict(table) for name, table in data.items()}
    for name, defaults in REASONING_GYM_RECIPE.items():
        out[name] = {**defaults, **out.get(name, {})}
    return out
