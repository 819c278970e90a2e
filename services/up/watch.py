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

from rlbus.bus import BusError
from rlbus.observability.tracing import task_traces
from rlbus.schemas import Heartbeat, SchemaError, ScoredGroup, Task
from rlbus.schemas.metric_keys import DraftKeys, SpeculativeKeys
from rlbus.services.runtime.config import RunSettings
from rlbus.services.up.monitor import Monitor
from rlbus.services.up.procs import Children
from rlbus.services.up.settings import UpSettings


def _line(row: dict[str, Any], mon: Monitor) -> str:
    acc = mon.accuracy
    return (f"step {row['step']:4d}  v{row['version']:<4d} reward {row.get('batch/reward_mean', 0):.3f}  "
            f"held-out {acc if acc is not None else float('nan'):.3f}  tok/s {mon.tokens_per_s:7.0f}  "
            f"stale {row.get('staleness/mean', 0):.2f}/{row.get('staleness/max', 0):.0f}  "
            f"k3 {row.get('mismatch/k3_kl', 0):.2e}  idle {row.get('trainer/idle_fraction', 0):.2f}"
            + _drafting(row))


def _drafting(row: dict[str, Any]) -> str:
    """With a drafter on: the latest tail's acceptance and tokens per target forward, and the draft's lag."""
    if SpeculativeKeys.ACCEPTANCE_RATE not in row:
        return ""
    lag = f" lag {row[DraftKeys.VERSION_LAG]:.0f}" if DraftKeys.VERSION_LAG in row else ""
    return (f"  draft acc {row[SpeculativeKeys.ACCEPTANCE_RATE]:.2f} "
            f"tok/fwd {row.get(SpeculativeKeys.TOKENS_PER_FORWARD, 0):.2f}{lag}")


FEED_CHUNK = 2048
FEED_DRY_S = 30.0  # trainer idle this long with no task queued: the task set is used up


async def _backlog(bus: Any, durable: str) -> int | None:
    """Tasks queued for the generators (None until a generator has created its consumer, or while
    the server does not answer)."""
    try:
        streams = await bus.streams()
    except BusError:
        return None
    for s in streams:
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
                with task_traces(chunk) as traces:  # each task's trace starts at its publish
                    await bus.publish_many([(subjects.tasks(t.pool), t.encode(), t.msg_id) for t in chunk],
                                           item_headers=traces)
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


class LiveView:
    """One line per trainer step: a rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, mon: Monitor, max_steps: int, *, live: bool) -> None:
        self.mon = mon
        self.progress: Any = None
        self._live: Any = None
        if live:
            from rich.live import Live
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]training"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(),
                                     TextColumn("{task.description}"))
            self._bar = self.progress.add_task("", total=max_steps)
            self._live = Live(self.progress, refresh_per_second=4)
            self._live.start()

    def step(self, row: dict[str, Any]) -> None:
        text = _line(row, self.mon)
        if self.mon.collapsed():
            text += "  !! COLLAPSED: reward 0 for 5 steps (lower [trainer].lr)"
        if self.progress is not None:
            self.progress.update(self._bar, completed=row["step"], description=text)
        else:
            print(text, flush=True)

    def note(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()


class UpWatch:
    """Follows a running pipeline until a stop rule fires: steps, held-out rounds, dead children,
    the task feed running dry, or a signal.  ``why`` and ``code`` say which."""

    def __init__(self, bus: Any, run_cfg: RunSettings, up_cfg: UpSettings, folder: Path, children: Children,
                 tasks: list[Any], *, view: bool) -> None:
        from rlbus.bus.subjects import Subjects

        self.bus, self.run_cfg, self.up_cfg = bus, run_cfg, up_cfg
        self.subjects = Subjects(run_cfg.run)
        self.children = children
        self.tasks = tasks
        self.mon = Monitor(folder / "metrics.jsonl", eval_size=up_cfg.eval_tasks)
        self.view = LiveView(self.mon, up_cfg.max_steps, live=view and sys.stdout.isatty())
        self.stop = asyncio.Event()
        self.code = 0
        self.why = ""
        self.final_eval = True  # one last held-out round of the final version before stopping

    def finish(self, why: str, *, code: int | None = None, final_eval: bool | None = None) -> None:
        """The first stop rule to fire names the reason."""
        if not self.stop.is_set():
            self.why = why
            if code is not None:
                self.code = code
            if final_eval is not None:
                self.final_eval = final_eval
        self.stop.set()

    def interrupted(self, sig: signal.Signals) -> None:
        # Ctrl-C means stop now: no final evaluation round, exit 130 like any interrupted command.
        self.finish(f"interrupted ({sig.name})", code=130, final_eval=False)

    async def follow_metrics(self) -> None:
        async for d in self.bus.watch(self.subjects.all_of("metrics"), deliver="new"):
            try:
                row = self.mon.on_heartbeat(Heartbeat.decode(d.msg))
            except SchemaError:
                continue
            if row is None:
                continue
            self.view.step(row)
            if row["step"] >= self.up_cfg.max_steps:
                self.finish(f"reached {self.up_cfg.max_steps} steps")

    async def follow_eval(self) -> None:
        async for d in self.bus.watch(self.subjects.scored(self.run_cfg.eval_pool), deliver="all"):
            try:
                row = self.mon.on_eval(ScoredGroup.decode(d.msg))
            except SchemaError:
                continue
            if row is None:
                continue
            where = "pinned" if row["pinned"] else f"live weights, versions {row['versions']}"
            self.view.note(f"eval @ v{row['eval_round']} ({where}): held-out accuracy "
                           f"{row['heldout/accuracy']:.3f} at {row['t']:.0f}s")
            rounds, target = self.up_cfg.stop_rounds, self.up_cfg.stop_at_accuracy
            sustained = self.mon.sustained_accuracy(rounds)
            if target and sustained is not None and sustained >= target:
                # A held-out round just measured the policy: no final round needed.
                self.finish(f"held-out accuracy {sustained:.3f} (mean of the last {rounds} rounds) >= {target}",
                            final_eval=False)

    async def follow_children(self) -> None:
        while not self.stop.is_set():
            dead = self.children.dead()
            if dead:
                c = dead[0]
                self.finish(f"service {c.name} exited with {c.proc.returncode}; last log lines:\n{c.tail()}",
                            code=1, final_eval=False)
            await asyncio.sleep(0.5)

    def idle_s(self) -> float:
        return time.time() - self.mon.t0 - (self.mon.steps[-1]["t"] if self.mon.steps else 0.0)

    async def feeding(self) -> None:
        why = await feed(self.bus, self.subjects, self.tasks, self.stop, epochs=self.up_cfg.epochs,
                         seed=self.up_cfg.seed, idle_s=self.idle_s)
        if why:
            self.finish(why, final_eval=False)  # the trainer is not done: no final round comes

    async def run(self) -> int:
        workers = [asyncio.create_task(f()) for f in (self.follow_metrics, self.follow_eval, self.follow_children,
                                                      self.feeding)]
        try:
            await self.stop.wait()
            if self.code == 0 and self.up_cfg.eval_tasks and self.final_eval:
                # One last evaluation of the final version, so the run ends on a measured number.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_await_eval(self.mon, self.mon.version), timeout=60)
        finally:
            for t in workers:
                t.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self.view.close()
        print(f"rlbus up: stopping ({self.why or 'interrupted'})", flush=True)
        if self.mon.evals:
            last = self.mon.evals[-1]
            print(f"rlbus up: final held-out accuracy {last['heldout/accuracy']:.3f} at "
                  f"{'version' if last['pinned'] else 'versions'} {', '.join(map(str, last['versions']))}",
                  flush=True)
        return self.code


async def watch(url: str, run_cfg: RunSettings, up_cfg: UpSettings, folder: Path, children: Children,
                tasks: list[Any], *, view: bool) -> int:
    from rlbus.bus.jetstream import JetStreamBus

    bus = await JetStreamBus.connect(url, run_cfg.run, name="rlbus-up-watch")
    try:
        from rlbus.services.commands.control import new_run

        await new_run(bus, [f"gen-{i}" for i in range(up_cfg.generators)])
        w = UpWatch(bus, run_cfg, up_cfg, folder, children, tasks, view=view)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, w.interrupted, sig)
        return await w.run()
    finally:
        await bus.close()


async def _await_eval(mon: Monitor, version: int) -> None:
    while not mon.evals or mon.evals[-1]["eval_round"] < version:
        await asyncio.sleep(0.5)
