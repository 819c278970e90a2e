"""A server restart under a running publisher and consumer: retries reuse the msg id, nothing is
stored twice, and the consumer carries on after reconnecting."""

from __future__ import annotations

import asyncio

import pytest

from rlbus.bus.protocol import Delivery
from rlbus.bus.server import EmbeddedServer
from tests.conftest import BUS_TEST_OPTIONS
from tests.integration.helpers import consuming, eventually, task_spec

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_publisher_retries_across_a_server_restart_without_duplicates(tmp_path):
    from rlbus.bus.jetstream import JetStreamBus

    server = EmbeddedServer(tmp_path / "nats")
    await server.astart()
    url = server.url
    bus = await JetStreamBus.connect(url, "restart", name="publisher", **BUS_TEST_OPTIONS)
    try:
        s = bus.subjects
        await bus.publish(s.tasks("math"), b"task-a", msg_id="task-a")

        await server.astop()
        # Published while the server is down: both keep retrying with their own msg ids.
        retry_a = asyncio.create_task(bus.publish(s.tasks("math"), b"task-a", msg_id="task-a"))
        new_b = asyncio.create_task(bus.publish(s.tasks("math"), b"task-b", msg_id="task-b"))
        await asyncio.sleep(1.0)
        assert not retry_a.done() and not new_b.done()

        await server.astart()  # same port, same store directory
        assert server.url == url
        async with asyncio.timeout(10):
            await asyncio.gather(retry_a, new_b)

        seen: list[bytes] = []

        async def handler(data: bytes, d: Delivery[bytes]) -> None:
            seen.append(data)

        async with consuming(bus, task_spec(bus), bytes, handler):
            await eventually(lambda: len(seen) >= 2)
            await asyncio.sleep(0.3)
        assert sorted(seen) == [b"task-a", b"task-b"]  # task-a stored once, across the restart

        # The consumer side survives a restart too.
        seen.clear()
        async with consuming(bus, task_spec(bus), bytes, handler):
            await server.astop()
            await server.astart()
            await bus.publish(s.tasks("math"), b"task-c", msg_id="task-c")
            await eventually(lambda: seen == [b"task-c"], timeout=15)
    finally:
        await bus.close()
        await server.astop()
