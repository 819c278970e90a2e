"""The service lifecycle: a crashed worker ends the run with its error, a stop ends it, and neither
waits without bound for a worker that lost its cancellation (the zombie generator: on Python 3.11
``asyncio.wait_for`` returns normally when a cancel lands in the loop turn its future completed,
and nats-py's publish goes through it)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped

DEADLINE_S = 20.0  # generous: the machine is shared; the failure mode is "never"


class Boom(RuntimeError):
    pass


class Reply:
    """A request whose reply arrives in the same loop turn as a cancel of its waiter, the way a
    JetStream publish ack can arrive just as a TaskGroup cancels the heartbeat that sent it."""

    def __init__(self) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def wait(self) -> None:
        await asyncio.wait_for(self.future, timeout=3600)  # as nats-py's request does

    def arrive(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class Beater:
    """A heartbeat-like loop (``Beat.loop``): beats until ``stopping``; each beat waits for a reply."""

    def __init__(self, life: Lifecycle) -> None:
        self.life = life
        self.replies: list[Reply] = []
        self.beats = 0

    async def loop(self) -> None:
        while not self.life.stopping.is_set():
            reply = Reply()
            self.replies.append(reply)
            await reply.wait()
            self.beats += 1
            await asyncio.sleep(0)


async def test_a_crash_ends_the_run_with_its_error_while_another_worker_sleeps() -> None:
    life = Lifecycle(grace=1.0)
    slept = asyncio.Event()

    async def sleeper() -> None:
        slept.set()
        await life.sleep(3600)

    async def crasher() -> None:
        await slept.wait()
        raise Boom("worker crashed")

    t0 = time.monotonic()
    with pytest.raises(Boom, match="worker crashed"):
        async with asyncio.timeout(DEADLINE_S):
            await run_until_stopped(life, sleeper, crasher)
    assert time.monotonic() - t0 < DEADLINE_S


async def test_a_crash_ends_the_run_even_when_a_worker_swallows_its_cancel() -> None:
    life = Lifecycle(grace=1.0)
    beater = Beater(life)

    async def crasher() -> None:
        while not beater.replies:
            await asyncio.sleep(0)
        beater.replies[-1].arrive()  # the reply lands ...
        raise Boom("sampling thread died")  # ... in the turn the run cancels the beater

    with pytest.raises(Boom):
        async with asyncio.timeout(DEADLINE_S):
            await run_until_stopped(life, beater.loop, crasher)
    assert life.stopping.is_set()


async def test_a_stop_ends_the_run_even_when_a_worker_swallows_its_cancel_and_ignores_stopping() -> None:
    life = Lifecycle(grace=0.5)
    swallowed: list[int] = []
    waiting = asyncio.Event()

    async def stubborn() -> None:
        while True:  # checks nothing: only a cancel that is not swallowed ends it
            waiting.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)  # the first cancel is lost, as in the wait_for race above

    async def stopper() -> None:
        await waiting.wait()
        life.shutdown()
        await asyncio.sleep(3600)

    async with asyncio.timeout(DEADLINE_S):
        await run_until_stopped(life, stubborn, stopper)
    assert swallowed == [1]


async def test_sleep_raises_a_cancel_that_comes_with_the_stop() -> None:
    life = Lifecycle()
    task = asyncio.create_task(life.sleep(3600))
    await asyncio.sleep(0.05)  # the task waits on ``stopping``
    life.shutdown()
    task.cancel()  # the same loop turn as the stop
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_worker_that_returns_does_not_stop_the_others() -> None:
    life = Lifecycle(grace=1.0)
    seen: list[str] = []

    async def quick() -> None:
        seen.append("quick")

    async def long() -> None:
        while not await life.sleep(0.01):
            if seen:
                seen.append("long")
                life.shutdown()

    async with asyncio.timeout(DEADLINE_S):
        await run_until_stopped(life, quick, long)
    assert seen[:2] == ["quick", "long"]


SERVICE = textwrap.dedent("""
    import asyncio, sys
    from rlbus.services.runtime.lifecycle import Lifecycle, run_until_stopped

    async def main():
        life = Lifecycle(grace=0.5)
        life.install_signal_handlers()

        async def stubborn():
            swallowed = False
            while True:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed = True  # a library that lost the first cancel it was sent

        async def ready():
            print("ready", flush=True)
            await asyncio.sleep(3600)

        await run_until_stopped(life, stubborn, ready)
        print("stopped", flush=True)

    asyncio.run(main())
""")


@contextlib.contextmanager
def ready_service(tmp_path: Path, source: str) -> Iterator[subprocess.Popen[str]]:
    """``source`` run as a service process (stdout and stderr in one pipe), once it printed
    'ready'; killed by pid on the way out if it is still running."""
    script = tmp_path / "svc.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_stops_a_service_whose_worker_ignores_cancellation(tmp_path: Path) -> None:
    with ready_service(tmp_path, SERVICE) as proc:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "stopped" in out


WAITER = textwrap.dedent("""
    import asyncio, threading, time
    from rlbus.services.runtime.lifecycle import Lifecycle

    async def pull_that_never_returns(gate):
        await gate.wait()

    async def main():
        life = Lifecycle()
        life.install_signal_handlers()
        threading.Thread(target=time.sleep, args=(3600,), name="sampler", daemon=True).start()
        task = asyncio.create_task(pull_that_never_returns(asyncio.Event()), name="batch-loop")
        print("ready", flush=True)
        await life.stopping.wait()
        task.cancel()

    asyncio.run(main())
""")


def _lines_until(proc: subprocess.Popen[str], found: Callable[[str], bool], timeout: float = 60.0) -> list[str]:
    """The service's output lines read up to and including the first that ``found`` accepts.

    A reader thread, so that a service that never prints it fails the test after ``timeout``
    instead of blocking it."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stream = proc.stdout

    def read() -> None:
        for line in stream:
            lines.put(line)
            if found(line):
                return
        lines.put("")  # end of output

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line, f"the service ended before printing what was awaited: {''.join(seen)}"
        seen.append(line)
        if found(line):
            return seen


def _is_task_dump(line: str) -> bool:
    return "where_everything_waits" in line and not line.lstrip().startswith("File ")


def test_sigusr1_logs_where_every_task_and_thread_waits_and_the_service_goes_on(tmp_path: Path) -> None:
    with ready_service(tmp_path, WAITER) as proc:
        proc.send_signal(signal.SIGUSR1)
        dump = _lines_until(proc, _is_task_dump)[-1]
        # SIGUSR2 only once the SIGUSR1 dump is written: faulthandler walks every thread's frames
        # without the interpreter's locks, and a walk that lands while the main thread is pushing
        # frames for the SIGUSR1 dump can crash the process (seen once in CI: SIGSEGV).
        proc.send_signal(signal.SIGUSR2)
        c_dump = _lines_until(proc, lambda line: "Thread 0x" in line or "Current thread 0x" in line)
        assert proc.poll() is None, "the dumps must not stop the service"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "batch-loop: " in dump and "pull_that_never_returns" in dump, dump
    assert "sampler" in dump, dump
    assert c_dump, "SIGUSR2: the C-level dump of every thread"
