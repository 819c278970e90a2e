"""Settings of the weight-broadcast service ([broadcast] table)."""

from typing import Literal

from pydantic import Field

from rlbus.services.runtime.config import Settings


class BroadcastSettings(Settings):
    instance: str = Field("broadcast-0", description="Instance name (metrics subject token).")
    transport: Literal["objstore", "file"] = Field("objstore", description="Where weight bytes live.")
    keep_versions: int = Field(3, ge=1, le=100, description="Versions retained; older ones are deleted once no generator uses them.")
    keep_eval_versions: int = Field(2, ge=0, le=100, description="Also retain the versions of the last N held-out "
                                    "rounds the controller scheduled, so generators can sample a round at exactly its version.")
    in_use_ttl: float = Field(15.0, gt=0, description="Seconds a generator heartbeat keeps its version 'in use'.")
