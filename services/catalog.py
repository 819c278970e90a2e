"""The services of an rlbus run, in one table: ``rlbus serve``, ``rlbus up``, the CLI and the
end-to-end harness all read it, so a new role is added here once.

Entries are in start order: a pipeline starts the services that answer or wait (environment,
reward, weight-broadcast, controller, trainer) before the generators that drive work through them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlbus.services.policy.drafter_names import ONLINE_DRAFTERS


def speculating(tables: Mapping[str, Any]) -> bool:
    """[generator.speculative] drafter = "model" or "model+group" in a run's config tables: a draft to
    distil online (the "static" drafters keep their first version, so they need no speculator)."""
    spec = tables.get("generator", {}).get("speculative", {})
    return isinstance(spec, Mapping) and spec.get("drafter") in ONLINE_DRAFTERS


@dataclass(frozen=True)
class ServiceEntry:
    name: str  # `rlbus serve <name>`, the config table [<name>] and the METRICS subject token
    module: str  # has ``async def run(run_cfg, cfg, *, bus, life)``
    settings: str  # "module:Class" of its typed settings
    torch: bool  # imports torch: needs a thread budget before the import
    replicas: bool  # `rlbus up` may start several (instance names gen-0, gen-1, …)
    # `rlbus up` starts it only when this says the run's config tables need it (None: always).
    only_if: Callable[[Mapping[str, Any]], bool] | None = None


SERVICES: dict[str, ServiceEntry] = {e.name: e for e in (
    ServiceEntry("environment", "rlbus.services.environment.service",
                 "rlbus.services.environment.settings:EnvironmentSettings", torch=False, replicas=False),
    ServiceEntry("reward", "rlbus.services.reward.service",
                 "rlbus.services.reward.settings:RewardSettings", torch=False, replicas=False),
    ServiceEntry("broadcast", "rlbus.services.broadcast.service",
                 "rlbus.services.broadcast.settings:BroadcastSettings", torch=False, replicas=False),
    ServiceEntry("controller", "rlbus.services.controller.service",
                 "rlbus.services.controller.settings:ControllerSettings", torch=False, replicas=False),
    ServiceEntry("trainer", "rlbus.services.trainer.service",
                 "rlbus.services.trainer.settings:TrainerSettings", torch=True, replicas=False),
    # Runs only with [generator.speculative] drafter = "model" / "model+group" (`rlbus up` starts it then): it
    # distils the draft on SCORED and uploads its versions, which weight-broadcast announces.
    ServiceEntry("speculator", "rlbus.services.speculator.service",
                 "rlbus.services.speculator.settings:SpeculatorSettings", torch=True, replicas=False, only_if=speculating),
    ServiceEntry("generator", "rlbus.services.generator.service",
                 "rlbus.services.generator.settings:GeneratorSettings", torch=True, replicas=True),
)}

# The singletons every pipeline runs; ``singletons(tables)`` adds those a config asks for.
SINGLETONS: tuple[str, ...] = tuple(n for n, e in SERVICES.items() if not e.replicas and e.only_if is None)


def singletons(tables: Mapping[str, Any]) -> tuple[str, ...]:
    """The singletons a run with these config tables needs, in start order."""
    return tuple(n for n, e in SERVICES.items() if not e.replicas and (e.only_if is None or e.only_if(tables)))


REPLICATED: tuple[str, ...] = tuple(n for n, e in SERVICES.items() if e.replicas)
