"""Run untrusted (model-written) programs with a stated, measured isolation.

Each execution gets: its own run directory (a private work dir, the only writable path), its
own Unix uid drawn from a pool (so the process-count limit binds per execution, the program
cannot signal the service or another execution, and every process it leaves behind can be
killed by uid), rlimits (address space, CPU, file size, process count, open files, no core),
a wall-clock limit after which everything of that uid dies, and output read concurrently
through pipes with a byte cap (past it the run is killed, so a program that prints forever
neither blocks nor grows the service).

Where bubblewrap exists the program also gets new user, pid, network, IPC, UTS and mount
namespaces with a root file system holding only /usr (the interpreter and its libraries), a
private /tmp, /proc, a minimal /dev and the work dir (the rest is read-only): no /etc, no
repository, no run dir, no hidden tests.  The program is pid 1 of its pid namespace
(``--as-pid-1``): bubblewrap then reaps it directly, so no orphaned zombie of the run's uid lingers
to eat the next run's process budget, and its CPU time comes back through ``wait4``; the price is
pid-1 semantics inside (signals without a handler are ignored, its exit ends every process of
the run).  Without bubblewrap, ``unshare -n`` still gives a private network when the
machine allows it, and the ``Isolation`` every ``Execution`` carries says what was missing.
Nothing here is silently weaker: ``probe()`` reports what this machine gives.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from rlbus.services.runtime.config import Settings

MiB = 1024 * 1024
# Where the sandboxed program finds its files (bwrap); without bwrap it runs in the host path.
SANDBOX_WORK = "/work"


class SandboxError(RuntimeError):
    """The sandbox could not run the program (not: the program failed); the message says why."""


class SandboxLimits(Settings):
    """Per-execution limits.  Small by default: a unit-test run of a short program."""

    wall_s: float = Field(10.0, gt=0, le=3600, description="Wall-clock seconds before every process of the run is killed.")
    cpu_s: int = Field(5, ge=1, le=3600, description="RLIMIT_CPU per process, seconds (then SIGKILL).")
    memory_mb: int = Field(512, ge=32, le=65536, description="RLIMIT_AS per process, MiB (allocation fails past it).")
    file_size_mb: int = Field(16, ge=1, le=4096, description="RLIMIT_FSIZE: largest file the program may write, MiB.")
    processes: int = Field(16, ge=2, le=4096, description=(
        "RLIMIT_NPROC for the run's own uid: every process and thread of the run, bubblewrap's own "
        "process and the program included (2 allows no fork or thread at all)."))
    open_files: int = Field(64, ge=16, le=65536, description="RLIMIT_NOFILE per process.")
    output_bytes: int = Field(64 * 1024, ge=1024, le=64 * MiB, description=(
        "Bytes kept of stdout and of stderr each; a run printing past it is killed (limit_hit='output')."))


class SandboxSettings(Settings):
    """How executions are isolated on this machine (the probe decides what is possible)."""

    python: str = Field("/usr/bin/python3", description=(
        "Interpreter for `code` runs; must live under /usr so it is visible inside the sandbox."))
    uid_base: int = Field(61000, ge=1000, le=2**31 - 2**16, description=(
        "First uid of the pool; each concurrent execution runs under its own uid (root only)."))
    max_concurrent: int = Field(4, ge=1, le=1024, description="Executions at once in this process.")
    uid_span: int = Field(1024, ge=1, le=65536, description=(
        "Uids of the pool from uid_base, shared by every sandbox on the host: each run leases one through a "
        "lock file (uid_lock_dir), so two services (or replicas) never run programs under the same uid."))
    uid_lock_dir: str = Field("", description=(
        "Host-wide folder of the uid leases; empty: /run/rlbus-sandbox as root, else <temp dir>/rlbus-sandbox."))
    root_dir: str = Field("", description="Where run dirs are made; empty: the system temp dir.")
    require_bwrap: bool = Field(False, description=(
        "Refuse to run (SandboxError) when bubblewrap is missing, instead of the weaker fallback."))
    limits: SandboxLimits = Field(default_factory=SandboxLimits, description="Default limits per execution.")


@dataclass(frozen=True)
class Isolation:
    """What this machine gave an execution; every Execution carries one."""

    bwrap: bool  # mount/pid/ipc/uts/user namespaces, no view of the host file system
    network_isolated: bool  # a private network namespace (loopback only)
    filesystem_isolated: bool  # only /usr, /tmp (private) and the work dir are visible
    separate_uid: bool  # own uid per execution: process limit per run, cannot signal the service
    rlimits: bool  # address space, CPU, file size, process count, open files, core 0
    # Without a network namespace, `run_code` refuses sockets through a Python audit hook: it
    # cannot be removed from inside, but native code (ctypes) or a child program bypasses it.
    sockets_refused_by_hook: bool = False

    def describe(self) -> str:
        missing = [name for name, ok in (("bubblewrap namespaces", self.bwrap),
                                         ("network isolation", self.network_isolated),
                                         ("file-system isolation", self.filesystem_isolated),
                                         ("a separate uid per run", self.separate_uid)) if not ok]
        if self.sockets_refused_by_hook:
            missing.append("sockets refused only by a Python audit hook")
        return "full isolation" if not missing else "NOT isolated: " + ", ".join(missing)


@dataclass(frozen=True)
class Execution:
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    wall_s: float
    cpu_s: float  # user + system seconds of the program and the children it reaped
    limit_hit: str | None  # "wall" | "cpu" | "memory" | "file_size" | "output" | None
    isolation: Isolation

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit_hit is None


def _try(argv: list[str], as_uid: int | None) -> bool:
    try:
        r = subprocess.run(argv, capture_output=True, timeout=10, user=as_uid, group=as_uid,
                           extra_groups=[] if as_uid is not None else None)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def _can_bwrap() -> bool:
    if shutil.which("bwrap") is None:
        return False
    # Probe as a run would, under a leased uid of the pool (unprivileged bwrap needs user namespaces,
    # root does not): an unleased uid may be a live run's, whose process limit the probe would eat.
    leases = UidLeases(SandboxSettings()) if os.geteuid() == 0 else None
    uid = leases.take_now() if leases is not None else None
    try:
        with tempfile.TemporaryDirectory() as work:
            if uid is not None:
                os.chown(work, uid, uid)
            return _try(_bwrap_argv(Path(work), {}) + ["/usr/bin/true"], uid)
    finally:
        if leases is not None and uid is not None:
            leases.release(uid)


def _can_unshare_net() -> bool:
    return shutil.which("unshare") is not None and _try(["unshare", "-n", "--", "/usr/bin/true"], None)


_PROBED: dict[str, bool] = {}


def _capabilities() -> dict[str, bool]:
    if not _PROBED:  # cached: what the machine allows does not change while the process runs
        _PROBED.update(bwrap=_can_bwrap(), unshare_net=_can_unshare_net(), root=os.geteuid() == 0)
    return _PROBED


def probe(*, use_bwrap: bool = True, use_netns: bool = True) -> Isolation:
    """What this machine gives an execution; ``use_*=False`` asks what the fallback would give."""
    cap = _capabilities()
    bwrap = use_bwrap and cap["bwrap"]
    net = bwrap or (use_netns and cap["unshare_net"])
    return Isolation(bwrap=bwrap, network_isolated=net, filesystem_isolated=bwrap, separate_uid=cap["root"],
                     rlimits=True, sockets_refused_by_hook=not net)


def _bwrap_argv(work: Path, ro_files: dict[str, Path]) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1",
            "--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        target = Path("/") / link
        if target.is_symlink():
            argv += ["--symlink", os.readlink(target), f"/{link}"]
        elif target.is_dir():
            argv += ["--ro-bind", str(target), f"/{link}"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
             "--bind", str(work), SANDBOX_WORK, "--chdir", SANDBOX_WORK]
    for inside, host in ro_files.items():
        argv += ["--ro-bind", str(host), inside]
    argv += ["--remount-ro", "/"]  # the namespace's root tmpfs: only /tmp and the work dir stay writable
    argv += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SANDBOX_WORK,
             "--setenv", "LANG", "C.UTF-8", "--"]
    return argv


# Installed before the program runs when there is no network namespace (see Isolation).
_SOCKET_GUARD = """
import runpy, sys
def _refuse(event, args):
    if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo"):
        raise PermissionError("network access is refused in this sandbox (no network namespace here)")
sys.addaudithook(_refuse)
del _refuse
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


def uid_processes(uid: int) -> list[int]:
    """Pids owned by ``uid`` (zombies included: they still count against its process limit)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            owner = os.stat(entry.path).st_uid
        except OSError:
            continue  # exited while we looked
        if owner == uid:
            found.append(int(entry.name))
    return found


class _Pipe:
    """Drain one pipe to its end, keeping at most ``cap`` bytes."""

    def __init__(self, stream: asyncio.StreamReader, cap: int) -> None:
        self.stream, self.cap = stream, cap
        self.kept = bytearray()
        self.truncated = False

    async def drain(self, on_overflow: asyncio.Event) -> None:
        while chunk := await self.stream.read(65536):
            room = self.cap - len(self.kept)
            if len(chunk) > room:
                self.kept += chunk[:room]
                self.truncated = True
                on_overflow.set()
                return  # the run is being killed; the pipe closes when its writers die
            self.kept += chunk


class Sandbox:
    """Runs programs under ``SandboxSettings``; ``run`` may be awaited concurrently."""

    def __init__(self, settings: SandboxSettings | None = None, *, use_bwrap: bool = True,
                 use_netns: bool = True) -> None:
        """``use_*=False`` runs the weaker fallback even where the machine has more (its tests)."""
        self.settings = settings or SandboxSettings()
        self.isolation = probe(use_bwrap=use_bwrap, use_netns=use_netns)
        if self.settings.require_bwrap and not self.isolation.bwrap:
            raise SandboxError("bubblewrap is required (require_bwrap) but `bwrap --unshare-all` does not work "
                               "here: install it (apt-get install bubblewrap) or set require_bwrap = false")
        self.root = Path(self.settings.root_dir or tempfile.gettempdir()) / f"rlbus-sandbox-{os.getpid()}"
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        self._slots = asyncio.Semaphore(self.settings.max_concurrent)
        self._leases = UidLeases(self.settings) if self.isolation.separate_uid else None
        self._resting: set[asyncio.Task] = set()

    async def run_code(self, code: str, **kw) -> Execution:
        """Run a Python program given as source (saved as ``main.py`` in the work dir)."""
        files = {"main.py": code, **kw.pop("files", {})}
        if self.isolation.sockets_refused_by_hook:
            return await self.run([self.settings.python, "-I", "-c", _SOCKET_GUARD], files=files, **kw)
        return await self.run([self.settings.python, "-I", "main.py"], files=files, **kw)

    async def run(self, argv: list[str], *, files: dict[str, str | bytes] | None = None, stdin: bytes = b"",
                  limits: SandboxLimits | None = None, ro_files: dict[str, Path] | None = None) -> Execution:
        """Run ``argv`` in a fresh work dir holding ``files``; ``ro_files`` maps absolute paths inside the
        sandbox to host files bound read-only (bwrap only; without it they are read from the host path)."""
        lim = limits or self.settings.limits
        await self._slots.acquire()
        uid = await self._leases.take() if self._leases is not None else os.getuid()
        run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self.root))
        try:
            os.chmod(run_dir, 0o711)
            work = run_dir / "work"
            work.mkdir(mode=0o700)
            for name, content in (files or {}).items():
                path = work / name
                if path.resolve().parent != work.resolve() and work.resolve() not in path.resolve().parents:
                    raise SandboxError(f"file name {name!r} leaves the work dir: give a relative path inside it")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content.encode() if isinstance(content, str) else content)
            if self.isolation.separate_uid:
                for p in [work, *work.rglob("*")]:
                    os.chown(p, uid, uid, follow_symlinks=False)
            full = self._argv(argv, work, ro_files or {}, uid)
            return await _Run(full, uid, work, lim, self.isolation).execute(stdin)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            if self.isolation.separate_uid and uid_processes(uid):
                # Killed processes of the namespace end as zombies reparented to the host's init,
                # which reaps them in its own time; until then they count against the uid's process
                # limit, so the uid rests instead of starting the next run short of processes.
                task = asyncio.create_task(self._rest(uid))
                self._resting.add(task)
                task.add_done_callback(self._resting.discard)
            else:
                self._give_back(uid)

    def _give_back(self, uid: int) -> None:
        if self._leases is not None:
            self._leases.release(uid)
        self._slots.release()

    async def _rest(self, uid: int, deadline_s: float = 30.0) -> None:
        try:
            t0 = time.monotonic()
            while uid_processes(uid) and time.monotonic() - t0 < deadline_s:
                await asyncio.sleep(0.1)
        finally:
            self._give_back(uid)  # past the deadline a stuck zombie costs one slot of its budget, not a uid

    def _argv(self, argv: list[str], work: Path, ro_files: dict[str, Path], uid: int) -> list[str]:
        if self.isolation.bwrap:
            return _bwrap_argv(work, ro_files) + argv
        if self.isolation.network_isolated:
            # unshare needs root for the namespace, then drops to the run's uid itself.
            ids = ["--setuid", str(uid), "--setgid", str(uid)] if self.isolation.separate_uid else []
            return ["unshare", "-n", *ids, "--", *argv]
        return list(argv)

    def close(self) -> None:
        """Remove the run dirs; safe to call twice.  Runs still in flight are the caller's to await."""
        for task in self._resting:
            task.cancel()
        shutil.rmtree(self.root, ignore_errors=True)


class UidLeases:
    """The uids of executions, leased host-wide: a uid is this process's while it holds an
    exclusive lock on ``<lock dir>/uid-<n>.lock``.  Every process running a sandbox on the host
    (two environment replicas, two test workers) draws from the same pool, and a run's uid is
    what its leftovers are killed by, so a uid shared by two live runs would let one kill the
    other's programs.  The kernel drops a lock when its holder dies, so a crashed service leaks
    no uid; what the crashed run left behind is killed when the uid is next leased."""

    def __init__(self, settings: SandboxSettings) -> None:
        self.base, self.span = settings.uid_base, settings.uid_span
        default = Path("/run/rlbus-sandbox") if os.geteuid() == 0 else Path(tempfile.gettempdir()) / "rlbus-sandbox"
        self.dir = Path(settings.uid_lock_dir) if settings.uid_lock_dir else default
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._held: dict[int, int] = {}  # uid -> fd of its lock
        self._next = 0

    async def take(self) -> int:
        while (uid := self.take_now()) is None:
            await asyncio.sleep(0.1)  # every uid of the pool is leased: wait for one
        return uid

    def take_now(self) -> int | None:
        """A uid no one on the host holds, or None when every uid of the pool is leased."""
        for _ in range(self.span):
            uid = self.base + self._next
            self._next = (self._next + 1) % self.span
            if uid not in self._held and self._lock(uid):
                if uid_processes(uid):  # a dead holder's leftovers: they die, the uid rests
                    _kill_uid(uid)
                    self.release(uid)
                    continue
                return uid
        return None

    def _lock(self, uid: int) -> bool:
        fd = os.open(self.dir / f"uid-{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._held[uid] = fd
        return True

    def release(self, uid: int) -> None:
        fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)  # closing drops the lock


def _kill_uid(uid: int) -> None:
    # kill(-1) from the run's own uid reaches every process it owns, in any namespace.
    subprocess.run(["kill", "-KILL", "-1"], user=uid, group=uid, extra_groups=[], capture_output=True, timeout=10)


class _Run:
    """One execution: spawn under limits, drain pipes, enforce the wall clock, reap by pidfd."""

    def __init__(self, argv: list[str], uid: int, work: Path, limits: SandboxLimits, isolation: Isolation) -> None:
        self.argv, self.uid, self.work, self.limits, self.isolation = argv, uid, work, limits, isolation
        self.killed_for: str | None = None

    def _preexec(self) -> None:
        lim = self.limits
        if self.isolation.separate_uid and not self.isolation.bwrap:
            os.setgroups([])  # unshare --setuid/--setgid keeps supplementary groups otherwise
        for res, value in ((resource.RLIMIT_AS, lim.memory_mb * MiB), (resource.RLIMIT_FSIZE, lim.file_size_mb * MiB),
                           (resource.RLIMIT_NOFILE, lim.open_files), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
        # Soft = hard: as pid 1 of its namespace the program ignores SIGXCPU, so the hard limit's SIGKILL
        # is what ends it; CPU time from wait4 tells that apart from the wall-clock kill.
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s))
        if self.isolation.separate_uid:  # NPROC counts per uid: only meaningful on a uid of its own
            resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes, lim.processes))

    async def execute(self, stdin: bytes) -> Execution:
        t0 = time.monotonic()
        # Popen drops to the run's uid itself, except where `unshare -n` must start as root and drop.
        sep = self.isolation.separate_uid and self.isolation.bwrap
        try:
            proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=self.work, start_new_session=True, preexec_fn=self._preexec, close_fds=True,
                user=self.uid if sep else None, group=self.uid if sep else None, extra_groups=[] if sep else None,
                env={"PATH": "/usr/bin:/bin", "HOME": str(self.work), "LANG": "C.UTF-8"})
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxError(f"could not start {self.argv[0]!r} for a sandboxed run ({exc}): check that it is "
                               "installed and that this service runs as root (a uid per run needs it)") from exc
        loop = asyncio.get_running_loop()
        transports: list[asyncio.BaseTransport] = []
        try:
            pipes = []
            for f in (proc.stdout, proc.stderr):
                reader = asyncio.StreamReader(limit=2**20)
                transport, _ = await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r), f)
                transports.append(transport)
                pipes.append(_Pipe(reader, self.limits.output_bytes))
            status, rusage = await self._supervise(proc, pipes, stdin)
        except BaseException:
            self._kill(proc)  # cancelled (service shutdown) or failed: the run must not outlive us
            proc.wait(timeout=10)  # killed, so this returns at once
            raise
        finally:
            for transport in transports:
                transport.close()  # closes the pipe too
        return self._execution(status, rusage, (pipes[0], pipes[1]), time.monotonic() - t0)

    async def _supervise(self, proc: subprocess.Popen, pipes: list[_Pipe], stdin: bytes):
        overflow = asyncio.Event()
        drains = [asyncio.create_task(p.drain(overflow)) for p in pipes]
        feeder = asyncio.create_task(asyncio.to_thread(self._feed, proc, stdin))
        exited = asyncio.create_task(self._wait(proc))
        overflowed = asyncio.create_task(overflow.wait())
        try:
            done, _ = await asyncio.wait({exited, overflowed}, timeout=self.limits.wall_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if exited not in done:
                self.killed_for = "output" if overflowed in done else "wall"
                self._kill(proc)
            status, rusage = await exited
            if self.isolation.separate_uid and uid_processes(self.uid):
                self._kill_leftovers()  # daemons that escaped the group die with their uid
            await asyncio.wait(drains, timeout=5)
            return status, rusage
        except BaseException:
            self._kill(proc)  # before awaiting the feeder, which a live program may block forever
            raise
        finally:
            for t in (*drains, overflowed, exited):
                t.cancel()
            await asyncio.gather(feeder, return_exceptions=True)

    @staticmethod
    def _feed(proc: subprocess.Popen, stdin: bytes) -> None:
        try:
            proc.stdin.write(stdin)
        except (BrokenPipeError, OSError):
            pass  # the program exited or closed stdin without reading it all: its choice
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    @staticmethod
    async def _wait(proc: subprocess.Popen) -> tuple[int, resource.struct_rusage]:
        """Reap through a pidfd so the CPU time of the run comes back with its status."""
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(proc.pid)
        try:
            ready = loop.create_future()
            loop.add_reader(pidfd, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(pidfd)
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)  # keeps Popen from reaping it again
            return status, rusage
        finally:
            os.close(pidfd)

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        if self.isolation.separate_uid:
            _kill_uid(self.uid)

    def _execution(self, status: int, rusage: resource.struct_rusage, pipes: tuple[_Pipe, _Pipe],
                   wall: float) -> Execution:
        code = os.waitstatus_to_exitcode(status)
        sig = -code if code < 0 else None
        if self.isolation.bwrap and code > 128 and not self.killed_for:
            sig = code - 128  # bwrap reports a child killed by signal N as exit 128 + N
        cpu = rusage.ru_utime + rusage.ru_stime
        limit = self.killed_for
        tail = pipes[1].kept[-400:]
        if limit is None:
            # The rlimit counts exact run time, rusage is sampled per tick: measured 0.92 s under a 1 s
            # limit on two loaded cores.  A SIGKILL this service did not send, that near the limit, is it.
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= self.limits.cpu_s * 0.75):
                limit = "cpu"
            elif b"MemoryError" in tail or b"Cannot allocate memory" in tail:
                limit = "memory"
            elif sig == signal.SIGXFSZ or b"File too large" in tail:
                limit = "file_size"
        return Execution(stdout=bytes(pipes[0].kept), stderr=bytes(pipes[1].kept),
                         stdout_truncated=pipes[0].truncated, stderr_truncated=pipes[1].truncated,
                         exit_code=None if sig is not None else code, signal=sig, wall_s=wall, cpu_s=cpu,
                         limit_hit=limit, isolation=self.isolation)

