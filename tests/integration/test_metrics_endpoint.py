"""``[run] metrics_port`` on real service processes and a real nats-server: what Prometheus scrapes.

What an operator relies on: ``http://<host>:<port>/metrics`` of a running service shows the values
its heartbeat carries, exactly (the scrape of heartbeat N equals heartbeat N on the bus), real
ones included (a dead letter on the run's DEAD stream shows as ``rlbus_dead_letters``), labelled
with service, instance and run; and a second replica given a port already in use fails at start
with a message naming the key to change, rather than running without metrics.
"""

from __future__ import annotations

import asyncio
import math
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from observability.metrics import HeartbeatCollector
from schemas import Heartbeat
from services.controller.settings import ControllerSettings
from services.reward.settings import RewardSettings
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
