"""Child service processes of ``rlbus up``: start, watch, stop by their own pids.

Children die with ``rlbus up``: each asks the kernel (Linux ``prctl(PR_SET_PDEATHSIG)``) for SIGKILL
when its parent goes, so an ``rlbus up`` killed with SIGKILL (no chance to stop them in order) leaves
no service running against a NATS server that went with it.  SIGKILL rather than SIGTERM: the parent
that would have escalated a stuck graceful stop is gone, and a service loses nothing it would not
lose to any kill -9 (un-acked tasks and groups come back after their ack wait; the trainer resumes
from its last checkpoint).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class DieWithParent:
    """``preexec_fn`` of a child (runs in the child between fork and exec): SIGKILL it when the
    process that started it dies.  The parent may die before the request is in place (the kernel
    then never sends it), so the child checks afterwards that its parent is still the one that forked
    it, and kills itself if not.  Other platforms: nothing (children outlive a killed parent there)."""

    def __init__(self) -> None:
        self.parent = os.getpid()  # taken in the parent, before the fork

    def __call__(self) -> None:
        if not sys.platform.startswith("linux"):
            return
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed: the child would outlive its parent")
        if os.getppid() != self.parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), signal.SIGKILL)


def spawn(argv: Sequence[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` with its output appended to ``log_path``, in its own session (a Ctrl-C reaches
    only ``rlbus up``, which then stops children in order) and dying with this process."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as fh:
        return subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=DieWithParent())


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def peak_rss_mib(self) -> float | None:
        """The process's peak resident memory so far (Linux ``VmHWM``), None once it has exited."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
        except (OSError, ValueError, IndexError):
            return None
        return None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Children:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    def start(self, name: str, service: str, config: Path, env: dict[str, str] | None = None) -> Child:
        """``rlbus serve <service> --config <config>`` as child ``name``."""
        return self.run(name, [sys.executable, "-m", "rlbus.services.cli",
                               "serve", service, "--config", str(config)], env)

    def run(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        """Any command as child ``name`` (logged to ``<log_dir>/<name>.log``)."""
        log_path = self.log_dir / f"{name}.log"
        proc = spawn(argv, log_path, {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def peak_rss_mib(self) -> dict[str, float | None]:
        """Each running child's peak resident memory in MiB (read before it is stopped)."""
        return {c.name: c.peak_rss_mib() for c in self.children if c.proc.poll() is None}

    def stop(self, grace: float) -> dict[str, int | None]:
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in self.children:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                c.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=5)
        return {c.name: c.proc.returncode for c in self.children}
