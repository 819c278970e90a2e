"""``rlbus up`` killed with SIGKILL takes its services with it (Linux: PR_SET_PDEATHSIG, checked
against the race of a parent that dies before the child asked)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for `rlbus up`: starts one long-lived child through the same code, prints its pid, waits.
PARENT = """
import sys, time
from pathlib import Path
from rlbus.services.up.procs import Children
child = Children(Path(sys.argv[1])).run("service", [sys.executable, "-c", "import time; time.sleep(600)"])
print(child.proc.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting for its new parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_services_of_an_up_killed_with_sigkill_exit_with_it(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30.0
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), f"child {child} outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_whose_parent_died_before_it_asked_kills_itself() -> None:
    """The race: the parent is gone between fork and prctl (its pid no longer the child's parent)."""
    from rlbus.services.up.procs import DieWithParent

    probe = DieWithParent()
    probe.parent = -1  # as if the forking parent were not our parent any more
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=probe)
    try:
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_each_childs_peak_memory_is_read_before_it_is_stopped(tmp_path: Path) -> None:
    """`rlbus up` reports every service's peak resident memory (services.json): a child that holds
    about 64 MiB at its peak reports at least that, and a stopped child reports none."""
    from rlbus.services.up.procs import Children

    children = Children(tmp_path)
    grow = "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(600)"
    big = children.run("big", [sys.executable, "-c", grow])
    deadline = time.monotonic() + 60
    while "ready" not in big.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        peak = children.peak_rss_mib()
        assert peak["big"] is not None and peak["big"] >= 64, peak
    finally:
        codes = children.stop(5.0)
    assert codes["big"] is not None and children.peak_rss_mib() == {}
