"""A closed control loop on the in-memory bus for the controller's fault tests: the real controller
service, the real generator service (fake backend: no model), a fake environment that can be taken
down, and a trainer stand-in whose heartbeat the test sets.  Everything runs in this process and
stops with the test."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rlbus.bus.memory import MemoryBus
from rlbus.schemas import Control, EnvReply, EnvReplyBatch, EnvResetBatch, Heartbeat, SchemaError, Task
from rlbus.schemas.metric_keys import TrainerKeys
from rlbus.services.controller.service import Controller, EvalSchedule
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.generator import service as generator_service
from rlbus.services.generator.settings import GeneratorSettings
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.heartbeat import Beat
from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped

RUN = "faults"
GEN = "gen-0"


async def eventually(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met within {timeout}s")
        await asyncio.sleep(0.02)


class Sample:
    def __init__(self, version: int) -> None:
        self.completion_ids = [7, 8]
        self.behaviour_logprobs = np.array([-0.1, -0.2], np.float32)
        self.token_versions = np.full(2, version, np.int64)
        self.finish_reason = "length"


class Backend:
    """Two tokens per completion, at once."""

    eos_id = None

    def __init__(self) -> None:
        self.version = 0
        self.slowdown = 1.0

    def sample(self, prompts: list[list[int]], n: int, sampling: Any, stop_ids: list[int], seed: int) -> list[Any]:
        return [[Sample(self.version) for _ in range(n)] for _ in prompts]

    def stage(self, version: int, weights: Any) -> None:
        pass

    def apply_staged(self) -> bool:
        return False

    def decode(self, ids: list[int]) -> str:
        return "".join(str(i % 10) for i in ids)

    def metrics(self) -> dict[str, float]:
        return {}


class Environment:
    """Answers resets with three prompt tokens while ``up``; no responder at all while down."""

    def __init__(self, bus: MemoryBus) -> None:
        self.bus = bus
        self.up = False
        self.beat = Beat(bus, bus.subjects, "environment", "environment-0", period=0.2)
        self.beat.state = "running"

    async def reset_batch(self, data: bytes) -> bytes:
        tasks = EnvResetBatch.decode(data).tasks
        return EnvReplyBatch(replies=[EnvReply(episode_id=t.task_id, observation_ids=np.array([1, 2, 3], dtype="<i4"))
                                      for t in tasks]).encode()

    def start(self) -> None:
        self.up = True
        self.bus._servers.append((self.bus.subjects.env_any("reset_batch"), self.reset_batch))

    def stop(self) -> None:
        """Gone: no responder (as after a kill -9), no heartbeat."""
        self.up = False
        self.bus._servers = [s for s in self.bus._servers if s[1] != self.reset_batch]

    async def loop(self, life: Lifecycle) -> None:
        while not life.stopping.is_set():
            if self.up:
                await self.beat.send()
            if await life.sleep(self.beat.period):
                return


class Trainer:
    """The trainer's heartbeat as the test sets it (version, state, totals).  Raising ``dropped`` grows
    the admission window without a new version (which would need new weights on the generator)."""

    def __init__(self, bus: MemoryBus) -> None:
        self.bus = bus
        self.version = 0
        self.state = "running"
        self.trained = 0
        self.dropped = 0
        self.seq = 0
        self.alive = True

    async def send(self) -> None:
        self.seq += 1
        T = TrainerKeys
        hb = Heartbeat(service="trainer", instance="trainer-0", seq=self.seq, ts=time.time(), state=self.state,
                       version=self.version, metrics={T.VERSION: self.version, T.GROUPS_TRAINED_TOTAL: self.trained,
                                T.GROUPS_DROPPED_TOTAL: self.dropped})
        await self.bus.publish(self.bus.subjects.metrics("trainer", "trainer-0"), hb.encode(), msg_id=hb.msg_id)

    async def loop(self, life: Lifecycle) -> None:
        while not life.stopping.is_set():
            if self.alive:
                await self.send()
            if await life.sleep(0.2):
                return


class Loop:
    """Controller + generator + environment + trainer stand-in on one ``MemoryBus``."""

    def __init__(self, tmp_path: Path, *, env: bool = True, **controller: Any) -> None:
        self.bus = MemoryBus(RUN)
        self.s = self.bus.subjects
        self.tmp_path = tmp_path
        self.run_cfg = RunSettings(run=RUN, run_dir=str(tmp_path), pools=["train"], group_size=2, batch_groups=4,
                                   max_staleness=1)
        self.ctl_cfg = ControllerSettings(**{"route_period": 0.2, "refresh": 0.5, **controller})
        self.gen_cfg = GeneratorSettings(instance=GEN, min_batch_groups=1, batch_wait_s=0.0)
        self.env = Environment(self.bus)
        self.with_env = env
        self.trainer = Trainer(self.bus)
        self.backend = Backend()
        self.life = Lifecycle(grace=1.0)
        self.controller_life = Lifecycle(grace=1.0)
        self.controller: Controller | None = None
        self.tasks: list[asyncio.Task[Any]] = []
        self.controller_task: asyncio.Task[Any] | None = None

    async def __aenter__(self) -> Loop:
        if self.with_env:
            self.env.start()
        self.tasks = [asyncio.create_task(self.env.loop(self.life)), asyncio.create_task(self.trainer.loop(self.life))]
        return self

    def start_generator(self) -> None:
        self.tasks.append(asyncio.create_task(generator_service.run(self.run_cfg, self.gen_cfg, bus=self.bus,
                                                                    life=self.life, backend=self.backend)))

    def start_controller(self) -> Controller:
        self.controller_life = Lifecycle(grace=1.0)
        self.controller = Controller(self.run_cfg, self.ctl_cfg, bus=self.bus, life=self.controller_life,
                                     evals=EvalSchedule([], 0))
        self.controller_task = asyncio.create_task(run_until_stopped(self.controller_life, *self.controller.workers()))
        return self.controller

    async def stop_controller(self) -> None:
        self.controller_life.shutdown()
        if self.controller_task is not None:
            await asyncio.wait_for(self.controller_task, 10)

    async def __aexit__(self, *exc: object) -> None:
        self.life.shutdown()
        with contextlib.suppress(Exception):
            await self.stop_controller()
        for t in self.tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 10)
        await self.bus.close()

    async def publish_tasks(self, n: int, prefix: str = "t") -> None:
        tasks = [Task(run=RUN, task_id=f"{prefix}-{i}", pool="train", env="addition", prompt=f"{i}+1=",
                      answer=str(i + 1), group_size=2) for i in range(n)]
        await self.bus.publish_many([(self.s.tasks("train"), t.encode(), t.msg_id) for t in tasks])

    # --- what the test looks at --------------------------------------------------------------
    def heartbeat(self, service: str = "generator", instance: str = GEN) -> Heartbeat | None:
        beats = [Heartbeat.decode(d) for subj, d in self.bus.messages("METRICS") if subj == self.s.metrics(service, instance)]
        return beats[-1] if beats else None

    def gen_state(self) -> str:
        hb = self.heartbeat()
        return hb.state if hb else ""

    def gen_metric(self, key: str) -> float:
        hb = self.heartbeat()
        return hb.metrics.get(key, 0.0) if hb else 0.0

    def boot(self) -> str:
        hb = self.heartbeat()
        return str(hb.info.get("boot", "")) if hb else ""

    def published(self) -> int:
        return len(self.bus.messages("ROLLOUTS"))

    def decisions(self) -> list[tuple[str, Control]]:
        out = []
        for subj, data in self.bus.messages("CONTROL"):
            with contextlib.suppress(SchemaError):
                out.append((subj, Control.decode(data)))
        return out
