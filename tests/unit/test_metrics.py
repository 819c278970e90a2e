"""Prometheus metrics from heartbeats, and the Grafana dashboard that reads them.

What a user cares about: a scrape shows exactly the values the heartbeat carried (a counter is
the service's own count, labels come from the key's path), nothing a service sends is lost (an
unmapped key still shows), the endpoint frees its port when the service stops, and no panel of
the dashboard queries a metric the code does not produce.  The mapping's keys are checked against
the code that emits them, so a renamed heartbeat key cannot silently empty a panel.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rlbus.observability.metrics import MAPPED, HeartbeatCollector, MetricsEndpoint, MetricsError, exposed_names
from rlbus.schemas import Heartbeat
from rlbus.services.runtime.config import RunSettings

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "observability" / "grafana" / "rlbus.json"


def scrape(collector: HeartbeatCollector) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``{(sample name, labels): value}`` as a Prometheus server would parse the exposition."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def labels(service: str, instance: str, run: str = "r1", **more: str) -> frozenset[tuple[str, str]]:
    return frozenset({"service": service, "instance": instance, "run": run, **more}.items())


def beat(service: str, instance: str, seq: int, metrics: dict[str, float], **kw: object) -> Heartbeat:
    return Heartbeat(service=service, instance=instance, seq=seq, ts=1_800_000_000.0 + seq, metrics=metrics, **kw)


def test_a_scrape_shows_the_heartbeats_values_with_labels_from_the_key_path() -> None:
    c = HeartbeatCollector(run="r1")
    c.observe(beat("trainer", "0", 7, {
        "trainer/groups_trained_total": 96, "trainer/groups_stale": 3, "trainer/pool/math/groups_train": 40,
        "trainer/generator/gen-1/groups_filtered": 5, "mismatch/k3_kl": 2.5e-9, "staleness/mean": 0.75,
        "staleness/hist_5plus": 2, "batch/reward_mean": 0.625, "time/weight_upload_s": 0.125,
        "train/some_new_number": 4.0}, version=12, state="running"))
    got = scrape(c)
    t = ("trainer", "0")
    assert got[("rlbus_trainer_groups_trained_total", labels(*t))] == 96  # a counter: the service's own count
    assert got[("rlbus_trainer_groups_judged_total", labels(*t, outcome="stale"))] == 3
    assert got[("rlbus_trainer_pool_groups_judged_total", labels(*t, pool="math", outcome="train"))] == 40
    assert got[("rlbus_trainer_generator_groups_judged_total", labels(*t, generator="gen-1", outcome="filtered"))] == 5
    assert got[("rlbus_trainer_mismatch", labels(*t, measure="k3_kl"))] == 2.5e-9
    assert got[("rlbus_trainer_staleness_mean", labels(*t))] == 0.75
    assert got[("rlbus_trainer_staleness_rollouts", labels(*t, versions="5plus"))] == 2
    assert got[("rlbus_trainer_batch_reward_mean", labels(*t))] == 0.625
    assert got[("rlbus_trainer_weight_upload_seconds", labels(*t))] == 0.125
    # A key with no name of its own is still exported, under its heartbeat key.
    assert got[("rlbus_heartbeat_value", labels(*t, key="train/some_new_number"))] == 4.0
    # The heartbeat's own fields.
    assert got[("rlbus_policy_version", labels(*t))] == 12
    assert got[("rlbus_heartbeat_seq", labels(*t))] == 7
    assert got[("rlbus_service_state", labels(*t, state="running"))] == 1
    # groups_trained_total is not read as outcome "trained_total" of trainer/groups_{outcome}.
    assert not any(n == "rlbus_trainer_groups_judged_total" and ("outcome", "trained_total") in lab for n, lab in got)


def test_each_instance_keeps_its_latest_heartbeat_and_a_restart_reads_as_a_counter_reset() -> None:
    c = HeartbeatCollector(run="r1")
    c.observe(beat("generator", "gen-0", 1, {"generator/groups_published": 10, "generator/pool/math/published": 10}))
    c.observe(beat("generator", "gen-1", 1, {"generator/groups_published": 4}))
    c.observe(beat("generator", "gen-0", 2, {"generator/groups_published": 12, "generator/pool/math/published": 12}))
    got = scrape(c)
    assert got[("rlbus_generator_groups_published_total", labels("generator", "gen-0"))] == 12
    assert got[("rlbus_generator_groups_published_total", labels("generator", "gen-1"))] == 4
    assert got[("rlbus_generator_pool_groups_published_total", labels("generator", "gen-0", pool="math"))] == 12
    # gen-0 restarted: its process counts from zero again, which Prometheus's rate() reads as a reset.
    c.observe(beat("generator", "gen-0", 1, {"generator/groups_published": 1}))
    got = scrape(c)
    assert got[("rlbus_generator_groups_published_total", labels("generator", "gen-0"))] == 1
    assert ("rlbus_generator_pool_groups_published_total", labels("generator", "gen-0", pool="math")) not in got


def test_the_controllers_throughput_balance_queues_and_dead_letters_are_named() -> None:
    c = HeartbeatCollector(run="r1")
    c.observe(beat("controller", "0", 3, {
        "controller/balance/consumption": 1.5, "controller/balance/effective": 1.25,
        "controller/pool/math/effective": 1.0, "controller/queue/tasks/math/pending": 17,
        "controller/queue/scored/pending": 2, "controller/queue/dead/messages": 4, "controller/stall_s": 0.0}))
    got = scrape(c)
    ctl = ("controller", "0")
    assert got[("rlbus_controller_consumption_groups_per_second", labels(*ctl))] == 1.5
    assert got[("rlbus_controller_effective_groups_per_second", labels(*ctl))] == 1.25
    assert got[("rlbus_controller_pool_effective_groups_per_second", labels(*ctl, pool="math"))] == 1.0
    assert got[("rlbus_queue_tasks_pending", labels(*ctl, pool="math"))] == 17
    assert got[("rlbus_queue_scored_pending", labels(*ctl))] == 2
    assert got[("rlbus_dead_letters", labels(*ctl))] == 4


def test_every_name_a_scrape_shows_is_one_exposed_names_lists() -> None:
    c = HeartbeatCollector(run="r1")
    metrics: dict[str, float] = {}
    for m in MAPPED:  # one key per mapping, placeholders filled
        key = re.sub(r"\{outcome\}", "train", m.key)
        metrics[re.sub(r"\{\w+\}", "x", key)] = 1.0
    c.observe(beat("any", "0", 1, metrics | {"unmapped/key": 1.0}))
    names = {name for name, _ in scrape(c)}
    assert names == exposed_names(), names ^ exposed_names()


def test_every_mapped_key_is_one_the_code_emits() -> None:
    """A mapped key (its fixed part, for a pattern) must appear in the services' or schemas' source:
    a key renamed in the code would otherwise leave its metric, and the panels on it, empty."""
    source = "\n".join(p.read_text() for top in ("services", "schemas") for p in (ROOT / top).rglob("*.py"))
    missing = []
    for m in MAPPED:
        fixed = m.key.split("{")[0]
        last = m.key.rsplit("}", 1)[-1] if "{" in m.key else ""
        if f'"{fixed}' not in source or (last and last.lstrip("/") not in source):  # as a string's start
            missing.append(m.key)
    assert not missing, f"these heartbeat keys appear nowhere in services/ or schemas/: {missing}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_endpoint_serves_metrics_and_frees_its_port_when_stopped() -> None:
    port = _free_port()
    endpoint = MetricsEndpoint(port, run="r1", addr="127.0.0.1")
    endpoint.start()
    try:
        endpoint.heartbeats.observe(beat("reward", "0", 5, {"reward/groups": 9}))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        names = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert names["rlbus_reward_groups_total"] == 9
        assert "process_cpu_seconds_total" in names
        with pytest.raises(MetricsError, match=r"metrics_port"):  # a second replica on the same port
            MetricsEndpoint(port, run="r1", addr="127.0.0.1").start()
    finally:
        endpoint.stop()
        endpoint.stop()  # twice is harmless
    again = MetricsEndpoint(port, run="r1", addr="127.0.0.1")  # the port is free again
    again.start()
    again.stop()


def test_metrics_port_is_off_by_default_and_checked() -> None:
    assert RunSettings().metrics_port == 0
    assert RunSettings(metrics_port=9464).metrics_port == 9464
    with pytest.raises(ValueError, match="metrics_port"):
        RunSettings(metrics_port=70_000)


def test_rlbus_up_gives_each_service_its_own_metrics_port() -> None:
    from rlbus.services.runtime.config import ConfigError
    from rlbus.services.up.main import metrics_ports

    names = ["environment", "reward", "generator-0", "generator-1"]
    ports = metrics_ports(9464, names)
    assert [int(ports[n]["RLBUS_RUN__METRICS_PORT"]) for n in names] == [9464, 9465, 9466, 9467]
    assert metrics_ports(0, names) == {}  # off
    with pytest.raises(ConfigError, match="metrics_port"):
        metrics_ports(65_534, names)


# ---- the Grafana dashboard ----------------------------------------------------------------------


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # rows may hold collapsed panels
    return out


def test_every_dashboard_query_names_only_metrics_the_code_defines() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["query"] if isinstance(v.get("query"), str) else v["query"]["query"]
              for v in dashboard.get("templating", {}).get("list", []) if v.get("type") == "query"]
    assert len(exprs) >= 10, "the dashboard lost its queries"
    named = {n for e in exprs for n in re.findall(r"\brlbus_[a-zA-Z0-9_]+", e)}
    unknown = named - exposed_names()
    assert not unknown, f"the dashboard queries metrics that observability/metrics.py never produces: {unknown}"


def test_the_dashboard_has_the_panels_an_operator_looks_for() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    by_title = {p["title"]: p for p in _panels(dashboard) if p.get("type") != "row"}
    queried = {title: " ".join(t["expr"] for t in p.get("targets", [])) for title, p in by_title.items()}
    wanted = {"consumption_groups_per_second": "C", "effective_groups_per_second": "E", "staleness": "staleness",
              "mismatch": "mismatch", "reward": "reward", "weight_upload_seconds": "weight sync",
              "swap_pause": "weight sync", "dead_letters": "dead letters", "queue_": "queue depths"}
    for metric, what in wanted.items():
        assert any(metric in q for q in queried.values()), f"no panel queries {metric} ({what})"
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique for Grafana"


# ---- the Prometheus scrape config ---------------------------------------------------------------

PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def test_prometheus_scrapes_every_service_on_the_metrics_port_and_keeps_their_labels() -> None:
    import yaml

    from rlbus.services.catalog import SERVICES

    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "rlbus"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["honor_labels"] is True  # else the services' instance label becomes exported_instance
    (sd,) = job["dns_sd_configs"]
    assert set(sd["names"]) == set(SERVICES) and sd["port"] == 9464


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) not installed")
def test_promtool_accepts_the_scrape_config() -> None:
    done = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
