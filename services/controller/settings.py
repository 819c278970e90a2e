"""Settings of the controller ([controller] table)."""

from pydantic import Field, field_validator

from rlbus.services.controller.divergence import DivergenceConfig
from rlbus.services.runtime.config import Settings


class ControllerSettings(Settings):
    instance: str = Field("controller-0", description="Instance name (metrics subject token).")
    period: float = Field(0.05, gt=0, le=10, description="Seconds between control decisions.")
    silent_after: float = Field(5.0, gt=0, description="Seconds without a heartbeat before a generator counts as lost.")
    # Bounded: a plan hands out grants one group at a time, up to this many per generator, and the
    # window it hands out is read from the trainer's heartbeat (as large as 2**40 groups).
    max_outstanding: int = Field(64, ge=1, le=4096,
                                 description="Most un-started admitted groups one generator may hold (at most 4096).")
    eval_tasks: str = Field("", description="JSONL of held-out tasks to evaluate ('' = no evaluation).")
    eval_every: int = Field(5, ge=0, description="Evaluate every N policy versions (0 = never).")
    refresh: float = Field(2.0, gt=0, description="Seconds between re-sends of unchanged grants (late joiners).")
    pool_mix: dict[str, float] = Field(
        default_factory=dict,
        description="Target share of trained groups per pool, e.g. {a = 0.5, b = 0.5} ({} = equal over the run's "
                    "pools).  Changed at run time with a 'set_mix' Control to the controller "
                    "(`python -m rlbus.services.commands.control set-mix`), which wins over this value.")
    route_period: float = Field(2.0, gt=0, description="Seconds between routing and concurrency decisions.")
    tau: float = Field(20.0, gt=0, description="Seconds over which measured rates, latencies and fractions are smoothed.")
    stall_after: float = Field(
        120.0, gt=0, description="Seconds without progress (no group trained, dropped, held or published, no new "
                                 "version) before the controller reports a stall and its likely cause (CONTROL "
                                 "'stall' record, `rlbus status`, an error in its log).")
    divergence: DivergenceConfig = Field(
        default_factory=DivergenceConfig,
        description="[controller.divergence] table: the alarm that fires when training reward rises while held-out "
                    "accuracy falls over a window of versions (reward hacking, verifier bugs; "
                    "services/controller/divergence.py).  Needs held-out rounds (eval_tasks, eval_every).")

    @field_validator("pool_mix")
    @classmethod
    def _mix(cls, v: dict[str, float]) -> dict[str, float]:
        if v and (any(x < 0 for x in v.values()) or not any(x > 0 for x in v.values())):
            raise ValueError(f"pool_mix {v} needs non-negative shares, at least one positive")
        return v
