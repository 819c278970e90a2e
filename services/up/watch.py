"""The live part of ``rlbus up``: follow heartbeats and eval results until a stop rule fires."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from schemas import Heartbeat, SchemaError, ScoredGroup, Task
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
FEED_DRY_S = 30.0  # trainer idle this long with no task queued: the task set is used up


async def _backlog(bus: Any, durable: str) -> int | None:
    """Tasks queued for the generators (None until a generator has created its consumer)."""
    for s in await bus.streams():
        for c in s.consumers:
            if c.name == durable:
                return int(c.pending + c.ack_pending)
    return None


async def feed(bus: Any, subjects: Any, tasks: list[Task], stop: asyncio.Event, *, epochs: int, seed: int,
               idle_s: Callable[[], float]) -> str | None:
    """Publish training tasks as the backlog drains, so a long run never runs dry and a short one
    does not wait for tens of thousands of publishes before the first step.

    Each further epoch publishes the set again, reshuffled, under new task ids (``<id>.e<k>``) so
    deduplication and the trainer's ledger take them as new groups.  ``epochs`` 0 cycles until
    another rule stops the run; otherwise, once the last epoch is used up (nothing queued and the
    trainer idle for a while, holding at most a partial batch), returns why the run should stop."""
    durable = subjects.durable("generator", tasks[0].pool) if tasks else ""
    epoch = 0
    while tasks and not stop.is_set() and (epochs == 0 or epoch < epochs):
        order = tasks if epoch == 0 else [replace(t, task_id=f"{t.task_id}.e{epoch}")
                                          for t in random.Random(seed + epoch).sample(tasks, len(tasks))]
        sent = 0
        while sent < len(order) and not stop.is_set():
            first = epoch == 0 and sent == 0
            backlog = None if first else await _backlog(bus, durable)
            # Before a generator has made its consumer, the backlog is unknown: wait for it.
            if first or (backlog is not None and backlog < FEED_CHUNK):
                if sent == 0 and epoch > 0:
                    print(f"rlbus up: epoch {epoch + 1} over the {len(tasks)} training tasks", flush=True)
                chunk = order[sent:sent + FEED_CHUNK]
                await bus.publish_many([(subjects.tasks(t.pool), t.encode(), t.msg_id) for t in chunk])
                sent += len(chunk)
                continue
            await asyncio.sleep(1.0)
        epoch += 1
    while not stop.is_set():
        if await _backlog(bus, durable) == 0 and idle_s() > FEED_DRY_S:
            return (f"all {epochs} epoch(s) over the {len(tasks)} training tasks used "
                    "(raise [up].epochs or [up].train_tasks for a longer run)")
        await asyncio.sleep(1.0)
    return None


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
            sustained = mon.sustained_accuracy(up_cfg.stop_rounds)
            if up_cfg.stop_at_accuracy and sustained is not None and sustained >= up_cfg.stop_at_accuracy:
                outcome["why"] = (f"held-out accuracy {sustained:.3f} (mean of the last {up_cfg.stop_rounds} "
                                  f"rounds) >= {up_cfg.stop_at_accuracy}")
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

    def idle_s() -> float:
        return time.time() - mon.t0 - (mon.steps[-1]["t"] if mon.steps else 0.0)

    async def feeding() -> None:
        why = await feed(bus, subjects, tasks, stop, epochs=up_cfg.epochs, seed=up_cfg.seed, idle_s=idle_s)
        if why and not stop.is_set():
            outcome.update(why=why, final_eval=False)  # the trainer is not done: no final round comes
            stop.set()

    workers = [asyncio.create_task(f()) for f in (follow_metrics, follow_eval, follow_children, feeding)]
    try:
        await stop.wait()
        if (outcome["code"] == 0 and up_cfg.eval_tasks and outcome.get("final_eval", True)
                and not outcome["why"].startswith("held-out")):
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
