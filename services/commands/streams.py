"""``rlbus streams``: stream and consumer state of a run (pending, ack-pending, redelivered, dead)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict


def streams(run: str, nats_url: str, *, as_json: bool) -> int:
    async def go() -> list:
        from rlbus.bus.jetstream import JetStreamBus

        bus = await JetStreamBus.connect(nats_url, run, name="rlbus-streams")
        try:
            return await bus.streams()
        finally:
            await bus.close()

    states = asyncio.run(go())
    if as_json:
        print(json.dumps([asdict(s) for s in states], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"streams of run {run!r}")
    for col in ("stream", "messages", "bytes", "consumer", "pending", "ack pending", "redelivered"):
        table.add_column(col)
    for s in states:
        if not s.consumers:
            table.add_row(s.name, str(s.messages), str(s.bytes), "-", "-", "-", "-")
        for i, c in enumerate(s.consumers):
            table.add_row(s.name if i == 0 else "", str(s.messages) if i == 0 else "", str(s.bytes) if i == 0 else "",
                          c.name, str(c.pending), str(c.ack_pending), str(c.redelivered))
    Console().print(table)
    return 0
