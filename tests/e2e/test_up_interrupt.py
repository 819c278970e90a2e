"""Ctrl-C on `rlbus up`: every service and the embedded nats-server stop (SIGTERM, drain), none is
left behind, and the run folder still gets its report, final policy and a durable checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.services.up.monitor import load_metrics
from tests.e2e.harness import checkpoint_state

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc: no psutil needed)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces or parentheses: fields start after the last ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def test_ctrl_c_stops_every_service_and_leaves_a_complete_run_folder(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
run = "ctrlc"
model_path = "{tiny_model}"

[up]
train_tasks = 2000
eval_tasks = 50
max_steps = 100000

[trainer]
checkpoint_every = 2
""")
    run_dir = tmp_path / "run"
    # Its own process group, like a shell's foreground job: Ctrl-C signals the whole group.
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.services.cli", "up", str(config), "--run-dir", str(run_dir),
                             "--no-view"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while sum(r["kind"] == "train" for r in load_metrics(run_dir / "metrics.jsonl")) < 4:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "rlbus up made no 4 steps in 300 s"
            time.sleep(0.5)
        children = _children_of(proc.pid)
        assert len(children) >= 7, children  # nats-server + six services
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stopped_in = time.monotonic() - t0
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted (SIGINT)" in out, out[-3000:]
    assert not [pid for pid in children if _alive(pid)], "processes outlived rlbus up"
    # Every service stopped on its own (SIGTERM and drain), none had to be killed.
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["service_exit_codes"] and all(c == 0 for c in summary["service_exit_codes"].values()), summary
    assert stopped_in < 60, f"stopping took {stopped_in:.0f}s"
    # The run folder is complete: metrics, report, a loadable final policy, a durable checkpoint.
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert (run_dir / "final_policy" / "config.json").exists()
    trained = [r for r in load_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert checkpoint_state(run_dir)["step"] >= 4 and len(trained) >= 4
