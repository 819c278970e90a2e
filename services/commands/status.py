"""``rlbus status``: every service instance of a run, from its heartbeats, plus queue depths."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any


async def snapshot(bus: Any, run: str, seconds: float) -> dict[str, Any]:
    from bus.subjects import Subjects
    from schemas import Heartbeat, SchemaError

    subjects = Subjects(run)
    seen: dict[str, Heartbeat] = {}

    async def listen() -> None:
        async for d in bus.watch(subjects.all_of("metrics"), deliver="last_per_subject"):
            try:
                hb = Heartbeat.decode(d.msg)
            except SchemaError:
                continue
            seen[f"{hb.service}/{hb.instance}"] = hb

    try:
        await asyncio.wait_for(listen(), timeout=seconds)
    except TimeoutError:
        pass
    now = time.time()
    instances = {
        key: {"state": hb.state, "version": hb.version, "age_s": round(now - hb.ts, 1),
              "metrics": {k: round(v, 4) for k, v in hb.metrics.items()}}
        for key, hb in sorted(seen.items())
    }
    queues = {s.name: {"messages": s.messages, **{c.name: {"pending": c.pending, "ack_pending": c.ack_pending,
                                                            "redelivered": c.redelivered} for c in s.consumers}}
              for s in await bus.streams()}
    gens = [hb for hb in seen.values() if hb.service == "generator" and hb.state != "stopped"]
    trainer = next((hb for hb in seen.values() if hb.service == "trainer"), None)
    production = sum(hb.metrics.get("generator/groups_per_s", 0.0) for hb in gens)
    balance = {"generator_groups_per_s": production}
    if trainer is not None:
        balance["trainer_idle_fraction"] = trainer.metrics.get("trainer/idle_fraction", 0.0)
        balance["trainer_version"] = trainer.version
    return {"run": run, "instances": instances, "queues": queues, "balance": balance}


def status(run: str, nats_url: str, *, as_json: bool, seconds: float) -> int:
    async def go() -> dict[str, Any]:
        from bus.jetstream import JetStreamBus

        bus = await JetStreamBus.connect(nats_url, run, name="rlbus-status")
        try:
            return await snapshot(bus, run, seconds)
        finally:
            await bus.close()

    snap = asyncio.run(go())
    if as_json:
        print(json.dumps(snap, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {run!r}")
    for col in ("instance", "state", "version", "age s", "key metrics"):
        table.add_column(col)
    for key, inst in snap["instances"].items():
        m = inst["metrics"]
        keys = [k for k in m if k.endswith(("per_s", "idle_fraction", "in_flight", "groups_started", "reward/mean"))]
        table.add_row(key, inst["state"], str(inst["version"]), str(inst["age_s"]),
                      ", ".join(f"{k.split('/')[-1]}={m[k]}" for k in keys[:4]))
    Console().print(table)
    Console().print(f"balance: {snap['balance']}")
    return 0
