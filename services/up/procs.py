"""Child service processes of ``rlbus up``: start, watch, stop by their own pids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        fh = open(log_path, "ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # Own session: a Ctrl-C reaches only rlbus up, which then stops children in order.
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", service, "--config", str(config)],
                                stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        fh.close()
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

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
