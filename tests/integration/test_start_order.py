"""Services and the server start in any order: a service whose server is not up yet waits for it
(as for an outage mid-run, up to ``[run] publish_outage_s``) instead of exiting, which systemd units
and containers started side by side rely on."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from rlbus.bus.jetstream import JetStreamBus
from rlbus.bus.server import EmbeddedServer
from rlbus.services.up.procs import Children
from rlbus.services.up.tomlw import dumps
from tests.e2e.harness import wait_heartbeat

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_service_started_before_its_server_waits_for_it_and_runs(tmp_path: Path) -> None:
    port = _free_port()
    server = EmbeddedServer(tmp_path / "nats", port=port)
    config = tmp_path / "run.toml"
    config.write_text(dumps({"run": {"run": "order", "nats_url": f"nats://127.0.0.1:{port}", "run_dir": str(tmp_path),
                                     "publish_outage_s": 120.0}, "reward": {}}))
    children = Children(tmp_path / "logs")
    child = children.start("reward", "reward", config)
    try:
        time.sleep(12.0)  # past the 10 s a connect used to wait: the service is still up, waiting
        assert child.proc.poll() is None, f"the service gave up on a server that is not up yet:\n{child.tail(20)}"
        t_start = time.time()
        await server.astart()
        bus = await JetStreamBus.connect(server.url, "order", name="probe")
        try:
            hb = await wait_heartbeat(bus, lambda h: h.service == "reward" and h.ts > t_start, timeout=120)
            assert hb.state == "running"
            assert {s.name for s in await bus.streams()} >= {bus.subjects.stream("TASKS"), bus.subjects.stream("SCORED")}
        finally:
            await bus.close()
        assert child.proc.poll() is None
    finally:
        children.stop(10.0)
        await server.astop()


async def test_a_url_list_connects_to_the_member_that_is_up(tmp_path: Path) -> None:
    """``nats_url`` names a cluster's members separated by commas (deploy/compose.yaml does): the
    client tries them in turn, so a member that is down costs nothing."""
    server = EmbeddedServer(tmp_path / "nats")
    await server.astart()
    try:
        bus = await JetStreamBus.connect(f"nats://127.0.0.1:{_free_port()},{server.url}", "urls", name="probe")
        try:
            await bus.publish(bus.subjects.tasks("train"), b"x", msg_id="t1")
            assert bus.connection.nc.connected_url.port == server.port
        finally:
            await bus.close()
    finally:
        await server.astop()


async def test_what_a_service_reads_before_it_starts_waits_out_a_server_lost_after_connect(tmp_path: Path) -> None:
    """The trainer reads the newest weight version and declares its durable, weight-broadcast reads
    the newest manifest, before either runs: a server lost in the seconds after connecting is
    waited for (like a publish waits) instead of ending the service with ServerUnavailable."""
    import asyncio

    from rlbus.schemas import Task
    from tests.conftest import BUS_TEST_OPTIONS
    from tests.integration.helpers import task_spec

    server = EmbeddedServer(tmp_path / "nats")
    await server.astart()
    bus = await JetStreamBus.connect(server.url, "lost", name="trainer", **BUS_TEST_OPTIONS)
    try:
        weights = bus.subjects.weights("policy")
        await bus.publish(weights, b"v3", msg_id="w3")
        await server.astop()
        newest = asyncio.create_task(bus.last(weights, wait=True))
        durable = asyncio.create_task(bus.connection.ensure_consumer(task_spec(bus)))
        await asyncio.sleep(12.0)  # longer than a JetStream API request waits for its answer (10 s)
        assert not newest.done() and not durable.done(), "a start-up read gave up while the server was away"
        await server.astart()
        assert await asyncio.wait_for(newest, 60) == b"v3"
        assert await asyncio.wait_for(durable, 60) == bus.subjects.stream("TASKS")
        await bus.publish(bus.subjects.tasks("math"), Task(run="lost", task_id="t1", pool="math", env="addition",
                                                           prompt="1+1=").encode(), msg_id="t1")
        got = await bus.puller(task_spec(bus), Task.decode).fetch(1, timeout=5.0)
        assert [d.msg.task_id for d in got] == ["t1"]
        await got[0].ack()
    finally:
        await bus.close()
        await server.astop()
