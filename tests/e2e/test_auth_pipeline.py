"""A whole pipeline with one least-privilege NATS user per service (``rlbus auth init``): the run
trains and the weights reach the generator, and no service was refused anything on the way — so
the generated permissions cover everything the services really do, not just the table in
tests/integration/test_auth.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import pytest

from rlbus.bus.credentials import Credentials
from rlbus.bus.jetstream import JetStreamBus
from rlbus.bus.server import EmbeddedServer
from rlbus.schemas import Task
from rlbus.services.catalog import SINGLETONS
from rlbus.services.commands.auth import init
from rlbus.services.runtime.config import RunSettings
from rlbus.services.tasks.addition import make_split, write_jsonl
from tests.e2e.harness import Pipeline, wait_heartbeat

pytestmark = [pytest.mark.slow, pytest.mark.integration]

T = TypeVar("T")
RUN = "authpipe"
STEPS = 3


def violations(server: EmbeddedServer) -> list[str]:
    """The server's own account: it logs every publish/subscribe violation with the user and subject."""
    return [ln for ln in server.log_path.read_text(errors="replace").splitlines() if "Violation" in ln]


async def unrefused(server: EmbeddedServer, waiting: Awaitable[T]) -> T:
    """``waiting``, failed at once when the server refuses any service anything meanwhile (a
    missing grant otherwise shows only as a service that never gets on)."""
    task = asyncio.ensure_future(waiting)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=1.0)
            if refused := violations(server):
                raise AssertionError("the server refused:\n" + "\n".join(refused[:20]))
        return task.result()
    finally:
        task.cancel()


async def logged(path: Path, event: str, timeout: float) -> None:
    """Until the service log at ``path`` records ``event`` (a structlog event name)."""
    deadline = time.monotonic() + timeout
    while f'"event": "{event}"' not in path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} logged no {event!r} within {timeout:.0f} s")
        await asyncio.sleep(0.5)


async def test_a_pipeline_of_per_role_users_trains_without_a_refusal(tiny_model: Path, tmp_path: Path) -> None:
    heldout = tmp_path / "heldout.jsonl"
    write_jsonl(heldout, make_split("heldout", 8, seed=5), {"max_new_tokens": 6, "temperature": 0.0})
    tables = {
        "run": {"run": RUN, "model_path": str(tiny_model), "batch_groups": 4, "group_size": 4, "max_staleness": 1},
        "trainer": {"lr": 1e-4, "checkpoint_every": 2},
        # Held-out rounds too: the controller reads their scores on SCORED under its own user.
        "controller": {"eval_every": 1, "eval_tasks": str(heldout)},
        "generator": {"max_batch_groups": 4},
        "broadcast": {}, "reward": {}, "environment": {},
    }
    secrets = tmp_path / "auth"
    init(secrets, RunSettings(**tables["run"]))

    def login(role: str) -> dict[str, str]:
        return {"RLBUS_RUN__NATS_USER": role, "RLBUS_RUN__NATS_PASSWORD_FILE": str(secrets / f"{role}.password")}

    p = Pipeline(tmp_path, tables)
    p.server = EmbeddedServer(tmp_path / "nats", include=secrets / "auth.conf")
    with p:
        p.start_all(1, env={**{name: login(name) for name in SINGLETONS}, "gen-0": login("generator")})
        operator = Credentials.build(user="operator", password_file=str(secrets / "operator.password"))
        bus = await JetStreamBus.connect(p.server.url, RUN, name="e2e-operator", credentials=operator)
        try:
            tasks = [Task(run=RUN, task_id=t.task_id, pool="train", env="addition", prompt=t.prompt, answer=t.answer,
                          group_size=4) for t in make_split("train", 64, seed=5)]
            await bus.publish_many([(bus.subjects.tasks(t.pool), t.encode(), t.msg_id) for t in tasks])
            await unrefused(p.server, wait_heartbeat(
                bus, lambda hb: hb.service == "trainer" and hb.version >= STEPS, timeout=300))
            # Weights went trainer -> object store -> broadcast -> generator under their own users.
            await unrefused(p.server, wait_heartbeat(
                bus, lambda hb: hb.service == "generator" and hb.version >= 1, timeout=120))
            # A held-out round was scheduled, sampled, scored and read back by the controller.
            controller = next(c for c in p.children.children if c.name == "controller")
            await unrefused(p.server, logged(controller.log_path, "heldout_round", timeout=300))
        finally:
            await bus.close()
        logs = {c.name: c.log_path.read_text(errors="replace") for c in p.children.children}
    refused = {name: [ln for ln in text.splitlines() if "nats_permission_denied" in ln or "authorization violation" in ln.lower()]
               for name, text in logs.items()}
    assert not any(refused.values()), f"services were refused by the server: {refused}"
    assert not violations(p.server), "the server refused:\n" + "\n".join(violations(p.server)[:20])
    for name, text in logs.items():
        password = (secrets / f"{'generator' if name.startswith('gen') else name}.password").read_text().strip()
        assert password not in text, f"{name} logged its password"
