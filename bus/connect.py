"""The one way services get a bus: ``bus = await open_bus(url, run, name="reward-0")``."""

from __future__ import annotations

from typing import Any

from rlbus.bus.protocol import Bus, BusError


async def open_bus(url: str | None, run: str, *, name: str, **options: Any) -> Bus:
    """A ``JetStreamBus`` on ``url`` with the run's streams declared.  ``url`` is required: the
    in-memory bus is for handler tests and is built directly (``rlbus.bus.memory.MemoryBus``)."""
    if not url:
        raise BusError(
            "no NATS URL given; pass --nats-url (or set it in the run config), e.g. nats://127.0.0.1:4222, "
            "or start a local server with `rlbus nats`"
        )
    from rlbus.bus.jetstream import JetStreamBus  # the only import of nats-py, deferred for cheap CLI start-up

    return await JetStreamBus.connect(url, run, name=name, **options)
