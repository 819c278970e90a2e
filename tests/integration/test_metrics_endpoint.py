"""``[run] metrics_port`` on real service processes and a real nats-server: what Prometheus scrapes.

What an operator relies on: ``http://<host>:<port>/metrics`` of a running service shows the values
its heartbeat carries, exactly (the scrape of heartbeat N equals heartbeat N on the bus), real
ones included (a dead letter on the run's DEAD stream shows as ``rlbus_dead_letters``), labelled
with service, instance and run; and a second replica given a port already in use fails at start
with a message naming the key to change, rather than running without metrics.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlbus.observability.metrics import HeartbeatCollector
from rlbus.schemas import Heartbeat
from rlbus.services.controller.settings import ControllerSettings
from rlbus.services.reward.settings import RewardSettings
from tests.e2e.harness import Pipeline, wait_heartbeat

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

RUN = "promrun"
INSTANCE = {"controller": ControllerSettings().instance, "reward": RewardSettings().instance}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape_now(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


async def scrape(port: int, timeout: float = 60.0) -> Samples:
    """One scrape, waiting for the endpoint to come up (the process is still importing at first)."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await asyncio.to_thread(_scrape_now, port)
            except OSError:
                await asyncio.sleep(0.2)


def of(service: str, **labels: str) -> frozenset[tuple[str, str]]:
    return frozenset({"service": service, "instance": INSTANCE[service], "run": RUN, **labels}.items())


def expected_samples(hb: Heartbeat) -> Samples:
    """What the scrape of ``hb`` must show for each of its metrics that has a name of its own."""
    c = HeartbeatCollector(RUN)
    out: Samples = {}
    for key, value in hb.metrics.items():
        found = c.match(key)
        if found is not None:
            mapped, labels = found
            out[(mapped.exposed, of(hb.service, **labels))] = float(value)
    return out


async def scrape_with_its_heartbeat(bus: object, port: int, service: str) -> tuple[Samples, Heartbeat]:
    """A scrape and the heartbeat (from the bus) it was rendered from: the scrape names the seq, and a
    heartbeat is exported just before it is published, so the bus shows that seq or a later one."""
    for _ in range(10):
        got = await scrape(port)
        seq = int(got[("rlbus_heartbeat_seq", of(service))])
        hb = await wait_heartbeat(bus, lambda h, seq=seq: h.service == service and h.seq >= seq, timeout=30)  # type: ignore[arg-type]
        if hb.seq == seq:
            return got, hb
    raise AssertionError(f"ten scrapes of {service} each missed its heartbeat on the bus")


async def test_a_running_service_serves_exactly_its_heartbeat_on_metrics(tmp_path: Path) -> None:
    ports = {"controller": _free_port(), "reward": _free_port()}
    with Pipeline(tmp_path, {"run": {"run": RUN}, "controller": {}, "reward": {}}) as p:
        for name, port in ports.items():
            p.start(name, name, env={"RLBUS_RUN__METRICS_PORT": str(port)})
        bus = await p.bus()
        try:
            await bus.dead_letter(bus.subjects.tasks("train"), b"not a task", reason="planted",
                                  error="a dead letter the test put there")
            dead = ("rlbus_dead_letters", of("controller"))
            try:
                async with asyncio.timeout(60):  # the controller reads DEAD's size about once a second
                    while (got := await scrape(ports["controller"])).get(dead) != 1:
                        await asyncio.sleep(0.3)
            except TimeoutError:
                raise AssertionError(f"no {dead} = 1 within 60 s; the scrape showed {sorted(got)[:40]}") from None

            got, hb = await scrape_with_its_heartbeat(bus, ports["controller"], "controller")
            want = expected_samples(hb)
            assert ("rlbus_controller_consumption_groups_per_second", of("controller")) in want  # C is there
            differ = {k: (got.get(k), v) for k, v in want.items()
                      if got.get(k) != v and not (math.isnan(v) and math.isnan(got.get(k, 0.0)))}
            assert not differ, f"the scrape differs from the heartbeat of the same seq: {differ}"
            assert got[("rlbus_service_state", of("controller", state=hb.state))] == 1

            got = await scrape(ports["reward"])
            assert got[("rlbus_service_state", of("reward", state="running"))] == 1
            assert got[("rlbus_reward_groups_total", of("reward"))] == 0
            assert got[("process_resident_memory_bytes", frozenset())] > 0

            # A second replica given the same port: refused at start, with the key to change.
            clash = p.start("reward-clash", "reward", env={"RLBUS_RUN__METRICS_PORT": str(ports["reward"]),
                                                            "RLBUS_REWARD__INSTANCE": '"reward-1"'})
            code = await asyncio.to_thread(clash.proc.wait, 60)
            assert code == 2 and "metrics_port" in clash.tail(5), clash.tail(20)
            assert p.by_name["reward"].proc.poll() is None  # the first one is untouched
        finally:
            await bus.close()


# ---- the dashboard's queries on a real Prometheus -----------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[2] / "observability" / "grafana" / "rlbus.json"
# Which service's heartbeat carries a key, by its first path segment (the rest are the trainer's).
_SERVICE_OF = {"generator": "generator", "controller": "controller", "reward": "reward", "environment": "environment",
               "broadcast": "broadcast"}
_FILL = {"pool": "math", "generator": "gen-0", "outcome": "train", "versions": "0", "part": "pg", "measure": "k3_kl"}


def heartbeats_of_every_mapped_key(seq: int) -> list[Heartbeat]:
    """One heartbeat per service holding each key it maps, placeholders filled, counters at ``seq``."""
    from rlbus.observability.metrics import MAPPED

    metrics: dict[str, dict[str, float]] = {}
    for m in MAPPED:
        key = m.key
        for name, value in _FILL.items():
            key = key.replace("{" + name + "}", value)
        metrics.setdefault(_SERVICE_OF.get(key.split("/")[0], "trainer"), {})[key] = float(seq)
    metrics["trainer"] |= {"mismatch/abs_diff_mean": 1e-7, "mismatch/abs_diff_max": 1e-6, "mismatch/ess": 0.99}
    return [Heartbeat(service=s, instance="0" if s != "generator" else "gen-0", seq=seq, ts=time.time(), metrics=m,
                      version=seq) for s, m in metrics.items()]


def _prometheus_config(path: Path, target_port: int) -> None:
    path.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: rlbus\n    honor_labels: true\n"
                    f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n")


def _query(port: int, expr: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:  # a query Prometheus refuses (400) says why in its body
        return json.loads(exc.read())  # type: ignore[no-any-return]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="the Prometheus server is not installed")
async def test_every_dashboard_query_parses_and_finds_data_on_a_real_prometheus(tmp_path: Path) -> None:
    from rlbus.observability.metrics import MetricsEndpoint

    endpoint = MetricsEndpoint(_free_port(), run=RUN, addr="127.0.0.1")
    endpoint.start()
    prom_port = _free_port()
    _prometheus_config(tmp_path / "prometheus.yml", endpoint.port)
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed in finally
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        for hb in heartbeats_of_every_mapped_key(1):
            endpoint.heartbeats.observe(hb)
        async with asyncio.timeout(60):  # up, and one scrape in
            while not (await asyncio.to_thread(_query_or_none, prom_port, "rlbus_heartbeat_seq")):
                await asyncio.sleep(0.5)
        for hb in heartbeats_of_every_mapped_key(2):  # counters move, so rate() and increase() have data
            endpoint.heartbeats.observe(hb)
        async with asyncio.timeout(30):
            while not await asyncio.to_thread(_query_or_none, prom_port, "rlbus_heartbeat_seq == 2"):
                await asyncio.sleep(0.5)
        dashboard = json.loads(DASHBOARD.read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        refused, empty = {}, []
        for expr in exprs:
            answer = await asyncio.to_thread(_query, prom_port, expr.replace("$run", RUN))
            if answer["status"] != "success":
                refused[expr] = answer.get("error")
            elif not answer["data"]["result"]:
                empty.append(expr)
        assert not refused, f"Prometheus refuses these dashboard queries: {refused}"
        assert not empty, f"these dashboard queries find no data although every mapped metric is exported: {empty}"
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        log.close()
        endpoint.stop()


def _query_or_none(port: int, expr: str) -> list[Any] | None:
    """The result of an instant query, None while Prometheus is not up yet."""
    try:
        answer = _query(port, expr)
    except OSError:
        return None
    return answer["data"]["result"] if answer.get("status") == "success" else None
