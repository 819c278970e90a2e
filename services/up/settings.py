"""Settings of ``rlbus up`` ([up] table): the task set, stopping rule and process layout."""

from typing import Literal

from pydantic import Field

from rlbus.services.runtime.config import Settings

# A turn's token cap when [up] max_new_tokens is not set: an addition answer is at most 4 digits and
# <eos>; a calculator tool turn is `calc(` + 15 characters + `)` (services/policy/calc_init.py).
TURN_TOKENS = {"addition": 6, "calculator": 24}


class UpSettings(Settings):
    task: Literal["addition", "calculator"] = Field("addition", description="The learning task: 'addition' (3-digit "
                                                    "sums, one turn) or 'calculator' (four 3-digit terms and an "
                                                    "arithmetic tool: multi-turn episodes).")
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
                                "addition, 24 for calculator).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of training tasks.")
    init_target: float = Field(0.30, ge=0, le=1, description="Warm-start held-out accuracy when the model is built.")
    shutdown_grace: float = Field(15.0, gt=0, description="Seconds services get to stop after SIGTERM.")

    @property
    def turn_tokens(self) -> int:
        return self.max_new_tokens or TURN_TOKENS[self.task]
