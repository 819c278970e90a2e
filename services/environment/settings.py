"""Settings of the environment service ([environment] table)."""

from pydantic import Field

from rlbus.services.runtime.config import Settings
from rlbus.services.sandbox.sandbox import SandboxSettings


class EnvironmentSettings(Settings):
    instance: str = Field("env-0", description=(
        "Instance name: the metrics subject token, and the replica token of this instance's own step "
        "subject (env.<name>.step.<instance>), so it must be unique among the run's environment replicas."))
    episode_ttl_s: float = Field(600.0, gt=0, le=86400, description=(
        "An open episode with no step for this long is expired and its state closed; a later step of it "
        "is refused with an error saying it expired."))
    max_episodes: int = Field(4096, ge=1, le=1_000_000, description=(
        "Open episodes this replica holds at most; a new episode past it is refused (add replicas or raise it)."))
    observation_chars: int = Field(2000, ge=64, le=1_000_000, description=(
        "Characters kept of each of stdout and stderr in a `python` tool observation (the rest is cut, and "
        "the observation says how much)."))
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings, description=(
        "The code sandbox of the `python` environment (made at its first use)."))
