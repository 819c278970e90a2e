"""A pipeline of real service processes on a real nats-server, for end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rlbus.bus.jetstream import JetStreamBus
from rlbus.bus.server import EmbeddedServer
from rlbus.bus.subjects import Subjects
from rlbus.schemas import Control, Heartbeat, SchemaError
from rlbus.services.catalog import SINGLETONS
from rlbus.services.up.monitor import load_metrics
from rlbus.services.up.procs import Child, Children
from rlbus.services.up.tomlw import dumps

T = TypeVar("T")


class Pipeline:
    def __init__(self, root: Path, tables: dict[str, dict[str, Any]]) -> None:
        self.root = root
        self.tables = tables
        self.server = EmbeddedServer(root / "nats", port=-1)
        self.children = Children(root / "logs")
        self.config = root / "config.toml"
        self.run = tables["run"]["run"]
        self.subjects = Subjects(self.run)
        self.by_name: dict[str, Child] = {}

    def start_server(self) -> None:
        self.server.start()
        self.tables["run"] = {**self.tables["run"], "nats_url": self.server.url, "run_dir": str(self.root)}
        self.config.write_text(dumps(self.tables))

    def start(self, name: str, service: str, env: dict[str, str] | None = None) -> Child:
        child = self.children.start(name, service, self.config, env={"OMP_NUM_THREADS": "1", **(env or {})})
        self.by_name[name] = child
        return child

    def start_all(self, generators: int, *, slowdown: float | None = None,
                  env: dict[str, dict[str, str]] | None = None) -> None:
        """Every service of the run, then generators gen-0 … gen-<n-1>; ``env`` adds variables by
        process name, ``slowdown`` gives every generator a slowdown file (see ``set_slowdown``)."""
        env = env or {}
        for name in SINGLETONS:
            self.start(name, name, env=env.get(name))
        for i in range(generators):
            self.start_generator(f"gen-{i}", slowdown=slowdown, env=env.get(f"gen-{i}"))

    def start_generator(self, instance: str, *, slowdown: float | None = None,
                        env: dict[str, str] | None = None) -> Child:
        gen_env = {"RLBUS_GENERATOR__INSTANCE": f'"{instance}"'}
        if slowdown is not None:
            self.set_slowdown(instance, slowdown)
            gen_env["RLBUS_GENERATOR__SLOWDOWN_FILE"] = f'"{self.slowdown_file(instance)}"'
        return self.start(instance, "generator", env={**gen_env, **(env or {})})

    def slowdown_file(self, instance: str) -> Path:
        return self.root / f"slowdown-{instance}"

    def set_slowdown(self, instance: str, factor: float) -> None:
        """The generator's sampling-time multiplier, applied from its next batch on."""
        self.slowdown_file(instance).write_text(str(factor))

    def kill9(self, name: str) -> None:
        child = self.by_name[name]
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=10)
        self.children.children.remove(child)

    def stop(self) -> None:
        self.children.stop(10.0)
        self.server.stop()

    def __enter__(self) -> Pipeline:
        """``with Pipeline(...) as p``: the server is up inside; on the way out every process is
        stopped by pid, and when the test failed the services' log tails are printed first."""
        self.start_server()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is not None:
                self.ask_where_everything_waits()
                print(self.logs())
        finally:
            self.stop()

    def ask_where_everything_waits(self) -> None:
        """SIGUSR1 and SIGUSR2 to every live service: each logs the stack of its asyncio tasks and
        writes every thread's stack to stderr (``rlbus.services.runtime.lifecycle``)."""
        # One signal at a time, a second apart: a C-level dump that lands while the asyncio dump
        # is being written can crash the service (tests/unit/test_lifecycle.py).
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            for c in self.children.children:
                if c.proc.poll() is None:
                    os.kill(c.proc.pid, sig)
            time.sleep(1.0)

    def logs(self) -> str:
        return "\n".join(f"--- {c.name}\n{c.tail(20)}" for c in self.children.children)

    async def bus(self) -> JetStreamBus:
        return await JetStreamBus.connect(self.server.url, self.run, name="e2e-test")


async def wait_heartbeat(bus: JetStreamBus, pred: Callable[[Heartbeat], bool], timeout: float) -> Heartbeat:
    """The first heartbeat (from now) satisfying ``pred``; fails with a clear message on timeout."""
    return await wait_message(bus, bus.subjects.all_of("metrics"), Heartbeat.decode, pred, timeout, "heartbeat")


async def wait_message(bus: JetStreamBus, subject: str, decode: Callable[[bytes], T], pred: Callable[[T], bool],
                       timeout: float, what: str) -> T:
    """The first message on ``subject`` (the last per subject, then new ones) that decodes and
    satisfies ``pred``; on timeout an ``AssertionError`` with every service's last words."""
    w = bus.watch(subject, deliver="last_per_subject")
    try:
        async with asyncio.timeout(timeout):
            async for d in w:
                try:
                    msg = decode(d.msg)
                except SchemaError:
                    continue
                if pred(msg):
                    return msg
    except TimeoutError:
        raise AssertionError(f"no {what} as awaited within {timeout:.0f} s; last words:\n"
                             f"{await last_words(bus)}") from None
    finally:
        await w.aclose()
    raise AssertionError("unreachable")


async def last_words(bus: JetStreamBus, timeout: float = 3.0) -> str:
    """What each service last said (heartbeat: state, version, age, a few metrics) and the newest
    control record per subject (admission grants, stall reports): printed with a failed e2e
    assertion, since a CI log keeps the start of a failure and may cut the service logs."""
    keep = ("generator/groups_started", "generator/groups_published", "generator/grant_total", "trainer/step",
            "trainer/pending_groups", "controller/stall_s")
    lines: dict[str, str] = {}
    for kind in ("metrics", "control"):
        w = bus.watch(bus.subjects.all_of(kind), deliver="last_per_subject")
        try:
            async with asyncio.timeout(timeout):
                async for d in w:
                    lines[d.subject] = _describe(kind, d.subject, d.msg, keep)
        except TimeoutError:
            pass
        finally:
            await w.aclose()
    with contextlib.suppress(Exception):  # the server may be what failed
        for st in await bus.streams():
            lines[st.name] = f"stream {st.name}: {st.messages} messages, consumers " + ", ".join(
                f"{c.name}(pending={c.pending} ack_pending={c.ack_pending} redelivered={c.redelivered} "
                f"waiting={c.waiting})" for c in st.consumers)
    return "\n".join(lines.values())


def _describe(kind: str, subject: str, data: bytes, keep: tuple[str, ...]) -> str:
    tail = subject.split(".", 2)[-1]
    try:
        if kind == "metrics":
            hb = Heartbeat.decode(data)
            metrics = {k: v for k, v in hb.metrics.items() if k in keep}
            return (f"{tail}: state={hb.state} version={hb.version} age={time.time() - hb.ts:.0f}s "
                    f"{metrics}")
        return f"{tail}: {Control.decode(data).decision}"[:400]
    except SchemaError as exc:
        return f"{tail}: undecodable ({exc})"[:200]


def checkpoint_state(root: Path) -> dict[str, Any]:
    from rlbus.services.trainer.checkpoint import peek_newest  # the ledger lives beside the folder (ledger.py)

    newest = peek_newest(root / "checkpoints")
    assert newest is not None, f"no checkpoint in {root / 'checkpoints'}"
    folder, state = newest
    # The ledger must never run ahead of the model beside it: a crash would then restart from
    # weights without updates the ledger calls trained.  (A step saved again is step-<N>-<seq>.)
    assert folder.name.startswith(f"step-{state.step:08d}"), f"{folder.name} holds the ledger of step {state.step}"
    return {"step": state.step, "version": state.version, "consumed": dict(state.consumed),
            "counters": state.counters}


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run_up(tmp_path: Path, config_toml: str, *, timeout: float) -> tuple[Path, list[dict[str, Any]]]:
    """Run `rlbus up` with this config as a user would; return the run folder and its metrics rows."""
    import subprocess
    import sys

    config = tmp_path / "run.toml"
    config.write_text(config_toml)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlbus.services.cli", "up", str(config), "--run-dir", str(run_dir),
                           "--no-view"], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, load_metrics(run_dir / "metrics.jsonl")


def record_stat(test: str, name: str, value: float, *, threshold: str) -> None:
    """Note a statistic an end-to-end test asserts, with its threshold, when ``RLBUS_TEST_STATS``
    names a file: bench/test_spread.py reruns the tests and reports each statistic's spread, which
    is what the margin written next to each threshold is measured from."""
    path = os.environ.get("RLBUS_TEST_STATS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"test": test, "stat": name, "value": float(value), "threshold": threshold,
                                 "loaded": os.environ.get("RLBUS_TEST_LOAD", ""), "t": time.time()}) + "\n")
