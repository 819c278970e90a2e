"""Settings of the generator service ([generator] table)."""

from typing import Literal

from pydantic import Field

from services.runtime.config import Settings


class GeneratorSettings(Settings):
    instance: str = Field("gen-0", description="Instance name: control and metrics subject token; unique per replica.")
    backend: Literal["torch", "vllm"] = Field("torch", description="Sampling engine behind the backend interface.")
    pools: list[str] = Field(default_factory=list, description="Pools to pull tasks from ([] = the run's train pools + eval pool).")
    max_batch_groups: int = Field(32, ge=1, le=1024, description="Most groups sampled together in one batch.")
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads (1 is fastest for small models on small machines).")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Sampling precision (bfloat16 injects a known mismatch).")
    deterministic: bool = Field(False, description="Batch-invariant logprobs, bit-identical to the trainer's.")
    admission: bool = Field(True, description="Start groups only within the controller's grant (bounded staleness).")
    transport: Literal["objstore", "file"] = Field("objstore", description="Weight transport (must match the broadcast's).")
    seed: int = Field(0, description="Sampling seed (combined with the instance name).")
    env_timeout: float = Field(10.0, gt=0, description="Seconds to wait for an environment reply.")
    slowdown: float = Field(1.0, ge=1.0, description="Testing aid: multiply sampling time (simulates a slow accelerator).")
