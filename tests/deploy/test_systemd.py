"""deploy/systemd: the units pass ``systemd-analyze verify``, keep their hardening and read their
role's NATS credentials; the template's own command line, run as a real process with its
environment files (the credentials `rlbus auth init` generates included) against three nodes run
from the shipped cluster config with the generated users, starts ``rlbus@generator-1`` as the
generator with instance ``generator-1``, logged in as ``generator``, and stops it cleanly.

What is not run here: systemd itself (no service manager on a test machine), so the sandboxing
directives are checked by ``systemd-analyze`` and by reading, not by running under them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlbus.bus.server import EmbeddedServer, free_port
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

CLUSTER_CONF = SYSTEMD.parent / "nats" / "cluster-node.conf"
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


def test_units_read_their_roles_credentials_last_and_require_them() -> None:
    """Every rlbus unit reads the NATS user and password `rlbus auth init --out /etc/rlbus/auth`
    writes for its role, after every other file (nothing else can change the identity), and
    without the ``-`` that would let it start with none."""
    expected = {"rlbus@.service": "/etc/rlbus/auth/%i.env", "rlbus-gpu@.service": "/etc/rlbus/auth/%i.env",
                "rlbus-trainer-torchrun.service": "/etc/rlbus/auth/trainer.env"}
    for name, path in expected.items():
        files = read_unit(SYSTEMD / name).values("Service", "EnvironmentFile")
        assert files[-1] == path, f"{name}: EnvironmentFile= {files}; the last should be {path}"
        assert sum("/etc/rlbus/auth/" in f for f in files) == 1, files
    assert set(expected) == {p.name for p in SYSTEMD.glob("rlbus*.service")}, "a new rlbus unit: add it here"
    shared = read_env_file(SYSTEMD / "rlbus.env")
    assert not {k for k in shared if "NATS_USER" in k or "NATS_PASSWORD" in k}, "rlbus.env is every role's: no identity"


class ShippedClusterNode(EmbeddedServer):
    """A node run from deploy/nats/cluster-node.conf as shipped: only its addresses, store and
    name are moved onto this machine (the peers nats-1..3 become loopback ports); its include
    of ./auth.conf is kept, with the generated file beside the config."""

    def __init__(self, root: Path, index: int, cluster_ports: list[int], auth_conf: Path) -> None:
        super().__init__(root / f"nats-{index}", port=free_port(), server_name=f"nats-{index}",
                         cluster_port=cluster_ports[index - 1])
        self.cluster_ports = cluster_ports
        self.dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(auth_conf, self.dir / "auth.conf")

    def config_text(self) -> str:
        text = CLUSTER_CONF.read_text()
        assert re.search(r"^include \./auth\.conf$", text, re.M), "cluster-node.conf no longer includes ./auth.conf"
        for old, new in (("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{self.port}"),
                         ("http: 0.0.0.0:8222", f"http: 127.0.0.1:{free_port()}"),
                         ("/data/jetstream", str(self.store_dir)),
                         ("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{self.cluster_port}"),
                         ("$NATS_NAME", json.dumps(self.server_name))):  # compose sets NATS_NAME per node
            assert text.count(old) == 1, f"cluster-node.conf changed ({old!r}); update this test"
            text = text.replace(old, new)
        text = re.sub(r"nats://nats-(\d):6222", lambda m: f"nats://127.0.0.1:{self.cluster_ports[int(m[1]) - 1]}", text)
        return text + f"ports_file_dir: {json.dumps(str(self.ports_dir))}\n"  # how start() finds it ready


async def test_template_runs_generator_1_with_its_roles_credentials(tmp_path: Path, tiny_model) -> None:
    """The whole credential path: `rlbus auth init` run as documented, the shipped cluster config
    with the generated users on three real nodes, and rlbus@generator-1's ExecStart with the
    shared, instance and credential files (generator-1.env there a symlink to generator.env)."""
    from rlbus.bus.credentials import Credentials, CredentialsError
    from rlbus.bus.jetstream import JetStreamBus
    from tests.e2e.harness import wait_heartbeat

    svc = ServiceProcess("rlbus@.service", "generator-1", tmp_path)
    run = f"deploy{os.getpid()}"
    (tmp_path / "etc" / "run.toml").write_text(
        f'[run]\nrun = "{run}"\nmodel_path = "{tiny_model}"\nrun_dir = "runs/{run}"\n')
    shared, own, creds = svc.env_files()
    assert (shared.name, own.name, creds.name, creds.parent.name) == ("rlbus.env", "generator-1.env", "generator-1.env", "auth")
    code = {"PATH": os.environ["PATH"], "PYTHONPATH": str(SYSTEMD.parents[1])}
    made = subprocess.run([f"{VENV_BIN}/rlbus", "auth", "init", "--config", str(tmp_path / "etc" / "run.toml"),
                           "--out", str(creds.parent)], env=code, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    creds.symlink_to("generator.env")  # the documented step for a suffixed instance

    cluster_ports = [free_port() for _ in range(3)]
    nodes = [ShippedClusterNode(tmp_path, i, cluster_ports, creds.parent / "auth.conf") for i in (1, 2, 3)]
    urls = ",".join(n.url for n in nodes)
    # The shipped examples, with the example server swapped for the cluster (docs/deploy.md).
    shared.write_text((SYSTEMD / "rlbus.env").read_text().replace("nats://127.0.0.1:4222", urls)
                      + "RLBUS_RUN__REPLICAS=3\n")
    own.write_text((SYSTEMD / "generator-1.env").read_text())
    proc = None
    try:
        await asyncio.gather(*(n.astart() for n in nodes))
        with pytest.raises(CredentialsError, match="wants credentials"):
            await JetStreamBus.connect(urls, run, name="anonymous", credentials=Credentials(), connect_timeout=10.0)
        log = tmp_path / "generator-1.log"
        proc = svc.start(log)
        operator = Credentials.build(user="operator", password_file=str(creds.parent / "operator.password"))
        bus = await JetStreamBus.connect(urls, run, name="deploy-test", credentials=operator, connect_timeout=120.0)
        try:
            hb = await wait_heartbeat(bus, lambda h: h.instance == "generator-1", timeout=180)
            assert hb.service == "generator"
            assert proc.poll() is None, log.read_text()[-3000:]
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=svc.stop_timeout())
            stopped_s = time.monotonic() - t0
        finally:
            await bus.close()
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        await asyncio.gather(*(asyncio.to_thread(n.stop) for n in nodes))
    text = log.read_text()
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    assert rc == 0, text[-3000:]
    config = next(x for x in lines if x.get("event") == "config")
    # The per-instance file reached the service (its threads), the unit name became its instance,
    # and it logged in as its role, whose password never reached its log.
    assert config["service"]["instance"] == "generator-1"
    assert config["service"]["threads"] == int(read_env_file(own)["RLBUS_GENERATOR__THREADS"])
    assert config["run"]["nats_user"] == "generator", config["run"]
    assert read_env_file(creds)["RLBUS_NATS_PASSWORD"] not in text
    assert not [x for x in lines if x.get("event") == "nats_permission_denied"], "a grant is missing"
    assert lines[-1]["event"] == "stopped", lines[-1]
    print(f"rlbus@generator-1 stopped {stopped_s:.1f} s after SIGTERM (TimeoutStopSec={svc.stop_timeout():.0f})")
