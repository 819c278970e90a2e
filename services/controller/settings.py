"""Settings of the controller ([controller] table)."""

from pydantic import Field

from services.runtime.config import Settings


class ControllerSettings(Settings):
    instance: str = Field("controller-0", description="Instance name (metrics subject token).")
    period: float = Field(0.05, gt=0, le=10, description="Seconds between control decisions.")
    silent_after: float = Field(5.0, gt=0, description="Seconds without a heartbeat before a generator counts as lost.")
    max_outstanding: int = Field(64, ge=1, description="Most un-started admitted groups one generator may hold.")
    eval_tasks: str = Field("", description="JSONL of held-out tasks to evaluate ('' = no evaluation).")
    eval_every: int = Field(5, ge=0, description="Evaluate every N policy versions (0 = never).")
    refresh: float = Field(2.0, gt=0, description="Seconds between re-sends of unchanged grants (late joiners).")
