"""Settings of the reward service ([reward] table)."""

from pydantic import Field

from rlbus.services.runtime.config import Settings
from rlbus.services.sandbox.sandbox import SandboxSettings


class RewardSettings(Settings):
    instance: str = Field("reward-0", description="Instance name (metrics subject token).")
    batch: int = Field(32, ge=1, le=512, description="Rollout groups fetched per pull.")
    concurrency: int = Field(8, ge=1, le=256, description="Groups scored and published at once (overlaps publish round trips; verifiers run inline).")
    format_weight: float = Field(0.0, ge=0.0, description="Added reward for a well-formed answer (0 = off).")
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings, description=(
        "The code sandbox of sandboxed verifiers (`code-tests`), made at their first use."))
