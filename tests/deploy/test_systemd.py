"""deploy/systemd: the units pass ``systemd-analyze verify`` and keep their hardening; the
template's own command line, run as a real process with its environment files, starts
``rlbus@generator-1`` as the generator with instance ``generator-1`` and stops it cleanly.

What is not run here: systemd itself (no service manager on a test machine), so the sandboxing
directives are checked by ``systemd-analyze`` and by reading, not by running under them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.deploy.units import (
    INSTALL_BIN,
    SYSTEMD,
    VENV_BIN,
    environment,
    local_copy,
    read_env_file,
    read_unit,
    systemd_analyze,
)

needs_analyze = pytest.mark.skipif(systemd_analyze() is None, reason="systemd-analyze is not installed")
# What each unit is verified as: templates instantiated the way docs/deploy.md starts them.
INSTANCES = ("rlbus@generator-1.service", "rlbus@environment.service", "rlbus-gpu@trainer.service",
             "rlbus-gpu@generator-2.service", "rlbus-trainer-torchrun.service", "nats.service")


def _analyze(units: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # SYSTEMD_UNIT_PATH: templates and drop-ins are looked up in the copy, not in /etc.
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"}
    return subprocess.run([str(systemd_analyze()), *args], env=env, capture_output=True, text=True, timeout=60)


@needs_analyze
@pytest.mark.parametrize("unit", INSTANCES)
def test_unit_verifies_without_a_warning(tmp_path: Path, unit: str) -> None:
    units = local_copy(tmp_path / "units")
    out = _analyze(units, "verify", unit)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), (
        f"systemd-analyze verify {unit}:\n{out.stdout}{out.stderr}")


@needs_analyze
def test_verify_here_reports_what_is_wrong(tmp_path: Path) -> None:
    """The check above can fail: a misspelt directive and a missing binary are both reported."""
    units = local_copy(tmp_path / "units")
    template = units / "rlbus@.service"
    template.write_text(template.read_text().replace("ProtectHome=yes", "ProtectHomes=yes")
                        .replace(f"{VENV_BIN}/rlbus", "/nonexistent/rlbus"))
    out = _analyze(units, "verify", "rlbus@generator-1.service")
    said = out.stdout + out.stderr
    assert "ProtectHomes" in said and "/nonexistent/rlbus" in said, said


@needs_analyze
@pytest.mark.parametrize(("unit", "most"), [("rlbus@generator-1.service", 2.0), ("nats.service", 2.0),
                                            ("rlbus-gpu@trainer.service", 3.5),
                                            ("rlbus-trainer-torchrun.service", 3.5)])
def test_units_are_hardened(tmp_path: Path, unit: str, most: float) -> None:
    """systemd's own exposure score (0 = locked down, 10 = none of its sandboxing): the CPU units
    are "OK" territory; GPU units give up device isolation and the system-call filter only."""
    units = local_copy(tmp_path / "units")
    out = _analyze(units, "security", "--offline=yes", unit)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout)
    assert found, out.stdout + out.stderr
    assert float(found.group(1)) <= most, out.stdout


def _directives(name: str, drop: tuple[str, ...] = ()) -> dict[tuple[str, str], list[str]]:
    unit = read_unit(SYSTEMD / name)
    out: dict[tuple[str, str], list[str]] = {}
    for section, key, value in unit.directives:
        if key not in drop:
            out.setdefault((section, key), []).append(value)
    return out


def test_gpu_template_differs_from_the_cpu_one_only_in_device_access() -> None:
    cpu, gpu = _directives("rlbus@.service"), _directives("rlbus-gpu@.service")
    differ = {k for k in cpu.keys() | gpu.keys() if cpu.get(k) != gpu.get(k)}
    assert differ == {("Unit", "Description"), ("Service", "PrivateDevices"), ("Service", "RestrictAddressFamilies"),
                      ("Service", "SystemCallFilter"), ("Service", "SystemCallErrorNumber"),
                      ("Service", "TimeoutStopSec"), ("Service", "LimitNOFILE")}, (
        "rlbus@.service and rlbus-gpu@.service drifted apart; change both or say why here")
    assert cpu[("Service", "PrivateDevices")] == ["yes"] and ("Service", "PrivateDevices") not in gpu


def test_torchrun_unit_is_hardened_like_the_gpu_template() -> None:
    own = ("Description", "Conflicts", "ExecStart", "Environment", "EnvironmentFile", "TimeoutStopSec")
    gpu = _directives("rlbus-gpu@.service", drop=own)
    torchrun = _directives("rlbus-trainer-torchrun.service", drop=own)
    assert torchrun == gpu, {k: (gpu.get(k), torchrun.get(k)) for k in gpu.keys() | torchrun.keys()
                             if gpu.get(k) != torchrun.get(k)}


class ServiceProcess:
    """The ``[Service]`` of a template instance as a process: its command line, environment
    and working directory from the unit, with the install paths moved into ``root``."""

    def __init__(self, template: str, instance: str, root: Path) -> None:
        self.unit = read_unit(SYSTEMD / template).instantiated(instance)
        self.root = root
        self.moved = {INSTALL_BIN: f"{VENV_BIN}/", "/etc/rlbus/": f"{root}/etc/",
                      "/var/lib/rlbus": f"{root}/state", "/var/cache/rlbus": f"{root}/cache"}
        (root / "etc").mkdir(parents=True)

    def path(self, value: str) -> str:
        for old, new in self.moved.items():
            value = value.replace(old, new)
        leftover = re.findall(r"(?<![\w/])/(?:opt|etc|var)/\S*", value)
        assert not leftover, f"{self.unit.name}: install path(s) {leftover} the test does not move"
        return value

    def env_files(self) -> list[Path]:
        return [Path(self.path(v.removeprefix("-"))) for v in self.unit.values("Service", "EnvironmentFile")]

    def start(self, log: Path) -> subprocess.Popen[bytes]:
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(SYSTEMD.parents[1])}  # this checkout's code
        env.update({k: self.path(v) for k, v in environment(self.unit).items()})
        for f in self.env_files():  # systemd reads them in order; a later file wins
            env.update(read_env_file(f))
        cwd = Path(self.path(self.unit.one("Service", "WorkingDirectory")))
        cwd.mkdir(parents=True, exist_ok=True)  # StateDirectory= does this under systemd
        argv = [self.path(a) for a in shlex.split(self.unit.one("Service", "ExecStart"))]
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def stop_timeout(self) -> float:
        value = self.unit.one("Service", "TimeoutStopSec")
        assert value.isdigit(), f"TimeoutStopSec={value}: the test reads plain seconds"
        return float(value)


async def test_template_runs_generator_1_as_instance_generator_1(tmp_path: Path, nats_server, tiny_model) -> None:
    from bus.jetstream import JetStreamBus
    from tests.e2e.harness import wait_heartbeat

    svc = ServiceProcess("rlbus@.service", "generator-1", tmp_path)
    run = f"deploy{os.getpid()}"
    (tmp_path / "etc" / "run.toml").write_text(
        f'[run]\nrun = "{run}"\nmodel_path = "{tiny_model}"\nrun_dir = "runs/{run}"\n')
    shared, own = svc.env_files()
    assert (shared.name, own.name) == ("rlbus.env", "generator-1.env")
    # The shipped examples, with the example server swapped for this test's.
    shared.write_text((SYSTEMD / "rlbus.env").read_text().replace("nats://127.0.0.1:4222", nats_server.url))
    own.write_text((SYSTEMD / "generator-1.env").read_text())
    assert read_env_file(shared)["RLBUS_RUN__NATS_URL"] == nats_server.url

    log = tmp_path / "generator-1.log"
    proc = svc.start(log)
    bus = await JetStreamBus.connect(nats_server.url, run, name="deploy-test")
    try:
        hb = await wait_heartbeat(bus, lambda h: h.instance == "generator-1", timeout=120)
        assert hb.service == "generator"
        assert proc.poll() is None, log.read_text()[-3000:]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=svc.stop_timeout())
        stopped_s = time.monotonic() - t0
    finally:
        await bus.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert rc == 0, log.read_text()[-3000:]
    config = next(x for x in lines if x.get("event") == "config")
    # The per-instance file reached the service (its threads), the unit name became its instance.
    assert config["service"]["instance"] == "generator-1"
    assert config["service"]["threads"] == int(read_env_file(own)["RLBUS_GENERATOR__THREADS"])
    assert lines[-1]["event"] == "stopped", lines[-1]
    print(f"rlbus@generator-1 stopped {stopped_s:.1f} s after SIGTERM (TimeoutStopSec={svc.stop_timeout():.0f})")
