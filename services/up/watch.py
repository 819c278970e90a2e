"""The live part of ``rlbus up``: follow heartbeats and eval results until a stop rule fires."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

from schemas import Heartbeat, SchemaError, ScoredGroup
from services.runtime.config import RunSettings
from services.up.monitor import Monitor
from services.up.procs import Children
from services.up.settings import UpSettings


def _line(row: dict[str, Any], mon: Monitor) -> str:
    acc = mon.accuracy
    return (f"step {row['step']:4d}  v{row['version']:<4d} reward {row.get('batch/reward_mean', 0):.3f}  "
            f"held-out {acc if acc is not None else float('nan'):.3f}  tok/s {mon.tokens_per_s:7.0f}  "
            f"stale {row.get('staleness/mean', 0):.2f}/{row.get('staleness/max', 0):.0f}  "
            f"k3 {row.get('mismatch/k3_kl', 0):.2e}  idle {row.get('trainer/idle_fraction', 0):.2f}")


FEED_CHUNK = 2048


async def feed(bus: Any, subjects: Any, tasks: list[Any], stop: asyncio.Event) -> None:
    """Publish training tasks as the backlog drains, so a long run never runs dry and a short one
    does not wait for tens of thousands of publishes before the first step."""
    durable = subjects.durable("generator", tasks[0].pool) if tasks else ""
    sent = 0
    while sent < len(tasks) and not stop.is_set():
        backlog = 0
        for s in await bus.streams():
            for c in s.consumers:
                if c.name == durable:
                    backlog = c.pending + c.ack_pending
        if sent == 0 or backlog < FEED_CHUNK:
            chunk = tasks[sent:sent + FEED_CHUNK]
            await bus.publish_many([(subjects.tasks(t.pool), t.encode(), f"task.{t.task_id}") for t in chunk])
            sent += len(chunk)
            continue
        await asyncio.sleep(1.0)
    if sent >= len(tasks):
        print(f"rlbus up: all {len(tasks)} training tasks published; raise [up].train_tasks for longer runs", flush=True)


async def watch(url: str, run_cfg: RunSettings, up_cfg: UpSettings, folder: Path, children: Children,
                tasks: list[Any], *, view: bool) -> int:
    from bus.jetstream import JetStreamBus
    from bus.subjects import Subjects

    subjects = Subjects(run_cfg.run)
    mon = Monitor(folder / "metrics.jsonl", eval_size=up_cfg.eval_tasks)
    stop = asyncio.Event()
    outcome: dict[str, Any] = {"code": 0, "why": ""}

    def interrupted(sig: signal.Signals) -> None:
        # Ctrl-C means stop now: no final evaluation round, exit 130 like any interrupted command.
        if not stop.is_set():
            outcome.update(code=130, why=f"interrupted ({sig.name})")
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted, sig)
    bus = await JetStreamBus.connect(url, run_cfg.run, name="rlbus-up-watch")
    live_view = view and sys.stdout.isatty()
    progress: Any = None
    if live_view:
        from rich.live import Live
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]training"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                            TimeElapsedColumn(), TextColumn("{task.description}"))
        bar = progress.add_task("", total=up_cfg.max_steps)
        live = Live(progress, refresh_per_second=4)
        live.start()

    def show(row: dict[str, Any]) -> None:
        text = _line(row, mon)
        if mon.collapsed():
            text += "  !! COLLAPSED: reward 0 for 5 steps (lower [trainer].lr)"
        if progress is not None:
            progress.update(bar, completed=row["step"], description=text)
        else:
            print(text, flush=True)

    async def follow_metrics() -> None:
        async for d in bus.watch(subjects.all_of("metrics"), deliver="new"):
            try:
                row = mon.on_heartbeat(Heartbeat.decode(d.msg))
            except SchemaError:
                continue
            if row is None:
                continue
            show(row)
            if row["step"] >= up_cfg.max_steps:
                outcome["why"] = f"reached {up_cfg.max_steps} steps"
                stop.set()

    async def follow_eval() -> None:
        async for d in bus.watch(subjects.scored(run_cfg.eval_pool), deliver="all"):
            try:
                row = mon.on_eval(ScoredGroup.decode(d.msg))
            except SchemaError:
                continue
            if row is None:
                continue
            where = "pinned" if row["pinned"] else f"live weights, versions {row['versions']}"
            msg = (f"eval @ v{row['eval_round']} ({where}): held-out accuracy "
                   f"{row['heldout/accuracy']:.3f} at {row['t']:.0f}s")
            if progress is not None:
                progress.console.print(msg)
            else:
                print(msg, flush=True)
            if up_cfg.stop_at_accuracy and row["heldout/accuracy"] >= up_cfg.stop_at_accuracy:
                outcome["why"] = f"held-out accuracy {row['heldout/accuracy']:.3f} >= {up_cfg.stop_at_accuracy}"
                stop.set()

    async def follow_children() -> None:
        while not stop.is_set():
            dead = children.dead()
            if dead:
                c = dead[0]
                outcome["code"] = 1
                outcome["why"] = f"service {c.name} exited with {c.proc.returncode}; last log lines:\n{c.tail()}"
                stop.set()
            await asyncio.sleep(0.5)

    workers = [asyncio.create_task(f()) for f in (follow_metrics, follow_eval, follow_children)]
    workers.append(asyncio.create_task(feed(bus, subjects, tasks, stop)))
    try:
        await stop.wait()
        if outcome["code"] == 0 and up_cfg.eval_tasks and not outcome["why"].startswith("held-out"):
            # One last evaluation of the final version, so the run ends on a measured number.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_await_eval(mon, mon.version), timeout=60)
    finally:
        for t in workers:
            t.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        if progress is not None:
            live.stop()
        await bus.close()
    print(f"rlbus up: stopping ({outcome['why'] or 'interrupted'})", flush=True)
    if mon.evals:
        last = mon.evals[-1]
        print(f"rlbus up: final held-out accuracy {last['heldout/accuracy']:.3f} at "
              f"{'version' if last['pinned'] else 'versions'} {', '.join(map(str, last['versions']))}", flush=True)
    return int(outcome["code"])


async def _await_eval(mon: Monitor, version: int) -> None:
    while not mon.evals or mon.evals[-1]["eval_round"] < version:
        await asyncio.sleep(0.5)
