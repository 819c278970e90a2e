"""The services of an rlbus run, in one table: ``rlbus serve``, ``rlbus up``, the CLI and the
end-to-end harness all read it, so a new role is added here once.

Entries are in start order: a pipeline starts the services that answer or wait (environment,
reward, weight-broadcast, controller, trainer) before the generators that drive work through them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceEntry:
    name: str  # `rlbus serve <name>`, the config table [<name>] and the METRICS subject token
    module: str  # has ``async def run(run_cfg, cfg, *, bus, life)``
    settings: str  # "module:Class" of its typed settings
    torch: bool  # imports torch: needs a thread budget before the import
    replicas: bool  # `rlbus up` may start several (instance names gen-0, gen-1, …)


SERVICES: dict[str, ServiceEntry] = {e.name: e for e in (
    ServiceEntry("environment", "services.environment.service", "services.environment.settings:EnvironmentSettings",
                 torch=False, replicas=False),
    ServiceEntry("reward", "services.reward.service", "services.reward.settings:RewardSettings",
                 torch=False, replicas=False),
    ServiceEntry("broadcast", "services.broadcast.service", "services.broadcast.settings:BroadcastSettings",
                 torch=False, replicas=False),
    ServiceEntry("controller", "services.controller.service", "services.controller.settings:ControllerSettings",
                 torch=False, replicas=False),
    ServiceEntry("trainer", "services.trainer.service", "services.trainer.settings:TrainerSettings",
                 torch=True, replicas=False),
    ServiceEntry("generator", "services.generator.service", "services.generator.settings:GeneratorSettings",
                 torch=True, replicas=True),
)}

SINGLETONS: tuple[str, ...] = tuple(n for n, e in SERVICES.items() if not e.replicas)
REPLICATED: tuple[str, ...] = tuple(n for n, e in SERVICES.items() if e.replicas)
