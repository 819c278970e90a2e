"""Settings of the environment service ([environment] table)."""

from pydantic import Field

from services.runtime.config import Settings


class EnvironmentSettings(Settings):
    instance: str = Field("env-0", description="Instance name (metrics subject token).")
