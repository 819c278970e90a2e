"""Settings of the speculator service ([speculator] table): the online distillation of the draft model."""

from typing import Literal

from pydantic import Field, model_validator

from rlbus.services.runtime.config import Settings


class SpeculatorSettings(Settings):
    instance: str = Field("speculator-0", description="Instance name (metrics subject token).")
    draft_model_path: str = Field(
        "", description="The initial draft model's Hugging Face folder (services/policy/draft_model.py build_draft + "
        "save_draft): the same folder as [generator.speculative] draft_model_path, whose weights the generators start "
        "from.  Its own key (a service reads only its own table); `rlbus up` fills it from the generator's.  Required "
        "when the service runs.")
    batch_samples: int = Field(32, ge=1, le=4096, description="Rollouts per distillation step (one minibatch).")
    buffer_samples: int = Field(256, ge=1, le=65536, description="Most rollouts held for distillation; past it the "
                                "oldest are dropped (counted), since the draft should follow the newest policy.")
    publish_every: int = Field(10, ge=1, le=100000, description="Distillation steps between two draft versions "
                               "handed to weight-broadcast.")
    lr: float = Field(1e-3, gt=0, le=1.0, description="AdamW learning rate of the draft (services/policy/distill.py).")
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads.")
    transport: Literal["objstore", "file"] = Field("objstore", description="Where the draft's weight bytes go: "
                                                   "must be [broadcast].transport, as for the trainer.")
    max_deliver: int = Field(5, ge=1, le=100, description="Deliveries of a scored group before it is dead-lettered.")

    @model_validator(mode="after")
    def _buffer_holds_a_batch(self) -> "SpeculatorSettings":
        if self.buffer_samples < self.batch_samples:
            raise ValueError(f"buffer_samples = {self.buffer_samples} is below batch_samples = {self.batch_samples}: "
                             "the buffer must hold at least one minibatch; raise buffer_samples")
        return self
