"""Sandbox containment: each escape attempt is contained AND the sandbox serves a normal run
right after (the service that owns it keeps serving).  Real bubblewrap, real processes, small
limits so each attempt ends in about a second.  Needs root (a uid per run) and bubblewrap."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from rlbus.services.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxSettings, probe
from rlbus.services.sandbox.sandbox import UidLeases, uid_processes
from tests.integration.sandbox_cases import (
    CPU_LOOP,
    FORK_BOMB,
    HUGE_OUTPUT,
    KILL_PARENT,
    MEMORY_BOMB,
    connect_code,
    exists_code,
    host_listener,
    outside_paths,
    secret_paths,
    write_code,
)

ISO = probe()
pytestmark = pytest.mark.skipif(not (ISO.bwrap and ISO.separate_uid),
                                reason="needs bubblewrap and root (apt-get install bubblewrap; run as root)")
SMALL = SandboxLimits(wall_s=4, cpu_s=1, memory_mb=256, processes=16, file_size_mb=1, output_bytes=4096)
# Apart from the default pool, and one range per test worker (pytest -n runs this file's tests on
# both workers at once): the leftover checks below look at this worker's uids only.
UID_BASE = 61100 + 32 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
UID_SPAN = 8


def leftovers(uids: range, wait_s: float = 5.0) -> list[int]:
    """Processes of ``uids`` still there after ``wait_s`` (zombies of killed runs are reaped by the
    host's init in its own time, so a short wait is part of the contract, not slack)."""
    deadline = time.monotonic() + wait_s
    while (found := [p for u in uids for p in uid_processes(u)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


@pytest.fixture
async def sandbox():
    sb = Sandbox(SandboxSettings(uid_base=UID_BASE, uid_span=UID_SPAN, max_concurrent=4, limits=SMALL))
    yield sb
    sb.close()
    assert not leftovers(range(UID_BASE, UID_BASE + UID_SPAN)), "a sandboxed process outlived its run"


async def still_serves(sb: Sandbox) -> None:
    ex = await sb.run_code("print(sum(range(10)))")
    assert ex.ok and ex.stdout == b"45\n", (ex.exit_code, ex.stderr)


async def test_normal_run_reports_full_isolation(sandbox):
    ex = await sandbox.run_code("import sys; print(sys.stdin.read().upper()); sys.exit(3)", stdin=b"abc")
    assert (ex.stdout, ex.exit_code, ex.limit_hit) == (b"ABC\n", 3, None)
    assert ex.isolation.describe() == "full isolation"
    assert ex.isolation.network_isolated and ex.isolation.filesystem_isolated and ex.isolation.separate_uid


async def test_network_connect_refused(sandbox):
    # A real listener on the host's loopback: the sandbox's loopback is its own, so nothing arrives.
    with host_listener() as port:
        ex = await sandbox.run_code(connect_code(port))
        assert b"connected" not in ex.stdout and ex.stdout.count(b"refused") == 2, ex.stdout
    await still_serves(sandbox)


async def test_fork_bomb(sandbox):
    t0 = time.monotonic()
    ex = await sandbox.run_code(FORK_BOMB)
    assert not ex.ok and time.monotonic() - t0 < SMALL.wall_s + 3
    await still_serves(sandbox)


async def test_memory_bomb(sandbox):
    ex = await sandbox.run_code(MEMORY_BOMB)
    assert ex.limit_hit == "memory" and ex.exit_code == 1, (ex.limit_hit, ex.stderr[-200:])
    await still_serves(sandbox)


async def test_cpu_loop_killed_by_cpu_limit(sandbox):
    # A wall clock well past the CPU limit: two shared cores may give the loop half a core.
    ex = await sandbox.run_code(CPU_LOOP, limits=SMALL.model_copy(update={"wall_s": 15}))
    assert ex.limit_hit == "cpu" and ex.exit_code is None and ex.cpu_s >= SMALL.cpu_s * 0.75, (ex.cpu_s, ex.wall_s)
    await still_serves(sandbox)


async def test_sleeping_group_killed_by_wall_clock(sandbox):
    # A child in its own session outlives the group kill unless the uid kill reaches it.
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\ntime.sleep(600)"
    ex = await sandbox.run_code(code)
    assert ex.limit_hit == "wall" and SMALL.wall_s <= ex.wall_s < SMALL.wall_s + 3
    await still_serves(sandbox)


async def test_huge_output_capped_without_blocking(sandbox):
    ex = await sandbox.run_code(HUGE_OUTPUT)
    assert ex.limit_hit == "output" and ex.stdout_truncated
    assert len(ex.stdout) == SMALL.output_bytes and len(ex.stderr) <= SMALL.output_bytes
    await still_serves(sandbox)


async def test_large_file_stopped_by_file_size_limit(sandbox):
    ex = await sandbox.run_code("open('big', 'wb').write(b'x' * (4 << 20))")
    assert ex.limit_hit == "file_size", ex.stderr[-200:]
    await still_serves(sandbox)


async def test_writes_outside_work_dir_do_not_reach_host(sandbox, tmp_path):
    paths, host_files = outside_paths(tmp_path)
    ex = await sandbox.run_code(write_code(paths))
    assert ex.exit_code == 0, ex.stderr
    # Only the private /tmp (a tmpfs that vanishes with the run) accepted the write.
    assert b"wrote /tmp/escaped" in ex.stdout and ex.stdout.count(b"wrote") == 1, ex.stdout
    assert not any(f.exists() for f in host_files)
    await still_serves(sandbox)


async def test_cannot_read_hidden_files_repo_or_etc(sandbox, tmp_path):
    paths = secret_paths(tmp_path, sandbox.root)
    ex = await sandbox.run_code(exists_code(paths))
    assert ex.exit_code == 0 and ex.stdout.count(b" False") == len(paths), ex.stdout
    await still_serves(sandbox)


async def test_killing_the_parent_leaves_the_service_alive(sandbox):
    ex = await sandbox.run_code(KILL_PARENT)
    assert ex.exit_code in (0, None)  # kill(-1) may take the program down with everything else of its uid
    os.kill(os.getpid(), 0)
    await still_serves(sandbox)


async def test_runs_are_concurrent(sandbox):
    # A run stuck on the wall clock does not hold the event loop: quick runs finish meanwhile.
    slow = asyncio.create_task(sandbox.run_code("import time; time.sleep(600)"))
    t0 = time.monotonic()
    quick = await asyncio.gather(*(sandbox.run_code(f"print({i})") for i in range(3)))
    assert [q.stdout for q in quick] == [b"0\n", b"1\n", b"2\n"]
    assert time.monotonic() - t0 < SMALL.wall_s and not slow.done()
    assert (await slow).limit_hit == "wall"


async def test_file_names_cannot_leave_the_work_dir(sandbox):
    with pytest.raises(SandboxError, match="leaves the work dir"):
        await sandbox.run_code("pass", files={"../../escaped.py": "x"})
    await still_serves(sandbox)


async def test_cancelled_run_leaves_nothing_behind(sandbox):
    # A service shutting down cancels its runs: the program (which never reads its stdin) dies with them.
    run = asyncio.create_task(sandbox.run_code("import time; time.sleep(600)", stdin=b"x" * (1 << 20)))
    await asyncio.sleep(0.5)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert not leftovers(range(UID_BASE, UID_BASE + UID_SPAN))
    await still_serves(sandbox)


async def test_fallback_without_bwrap_says_what_it_lacks(tmp_path):
    sb = Sandbox(SandboxSettings(uid_base=UID_BASE + UID_SPAN, uid_span=1, max_concurrent=1, limits=SMALL), use_bwrap=False)
    try:
        assert not sb.isolation.filesystem_isolated and "file-system isolation" in sb.isolation.describe()
        ex = await sb.run_code("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
                               "except OSError as e:\n    print('refused', e.errno)")
        assert b"refused" in ex.stdout and ex.isolation.network_isolated  # `unshare -n` still here
        no_net = Sandbox(SandboxSettings(uid_base=UID_BASE + UID_SPAN + 1, uid_span=1, max_concurrent=1, limits=SMALL),
                         use_bwrap=False, use_netns=False)
        ex = await no_net.run_code("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)")
        no_net.close()
        assert b"network access is refused" in ex.stderr and "audit hook" in ex.isolation.describe()
    finally:
        sb.close()


async def test_two_sandboxes_on_one_host_never_share_a_uid(tmp_path):
    """Two services (or test workers) each with a sandbox on one host: a run's leftovers are
    killed by its uid, so a uid leased to both would let one kill the other's programs (seen when
    two test workers ran this file at once).  Leases are host-wide lock files, dropped with the
    process that held them."""
    settings = SandboxSettings(uid_base=UID_BASE + UID_SPAN + 2, uid_span=2, uid_lock_dir=str(tmp_path))
    a, b = UidLeases(settings), UidLeases(settings)
    first, second = await a.take(), await b.take()
    assert first != second
    waiting = asyncio.create_task(b.take())  # the pool of two is spent: the next lease waits
    await asyncio.sleep(0.3)
    assert not waiting.done()
    a.release(first)
    assert await asyncio.wait_for(waiting, 5) == first
    b.release(first)
    b.release(second)
