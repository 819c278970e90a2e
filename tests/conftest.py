"""Shared fixtures: one real nats-server per test session, a fresh bus per test.

The server is started from the venv's ``nats-server`` on a random loopback port in a temp dir and
stopped by its own pid at the end of the session (never by name).  Each test gets a
``JetStreamBus`` on a unique run name, so streams, durables and buckets never collide.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

_runs = itertools.count()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from bus.server import EmbeddedServer

    server = EmbeddedServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    """A run name unique to this test (streams are global on a server)."""
    base = "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]
    return f"t{os.getpid()}_{next(_runs)}_{base}"


BUS_TEST_OPTIONS = dict(error_backoff=(0.1, 0.5), shutdown_grace=2.0, publish_deadline=10.0)


@pytest.fixture
async def bus(nats_server: Any, run_name: str) -> AsyncIterator[Any]:
    from bus.jetstream import JetStreamBus

    b = await JetStreamBus.connect(nats_server.url, run_name, name="test", **BUS_TEST_OPTIONS)
    try:
        yield b
    finally:
        await b.close()
