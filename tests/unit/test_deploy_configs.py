"""The shipped deploy configs are valid: every run config under deploy/configs resolves for every
service, the compose file's run config keeps three replicas, and the cluster node's NATS config
passes ``nats-server -t`` with its JetStream fsyncing before it acknowledges."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from bus.server import find_nats_server
from services.catalog import SERVICES
from services.runtime.config import read_toml
from services.serve import resolve

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RUN_CONFIGS = sorted((DEPLOY / "configs").glob("*.toml"))


@pytest.fixture(autouse=True)
def _no_ambient_overrides(monkeypatch):
    for key in list(os.environ):
        if key.startswith("RLBUS_"):
            monkeypatch.delenv(key)


@pytest.mark.parametrize("config", RUN_CONFIGS, ids=lambda p: p.name)
def test_every_deploy_run_config_resolves_for_every_service(config):
    assert RUN_CONFIGS, "no run configs under deploy/configs"
    for service in SERVICES:
        _, run_cfg, _ = resolve(service, str(config))
        assert run_cfg.run


def test_the_compose_run_config_keeps_three_replicas():
    # compose.yaml runs a 3-node cluster and mounts deploy/configs/run.toml for every service.
    assert "run.toml" in (DEPLOY / "compose.yaml").read_text()
    _, run_cfg, _ = resolve("reward", str(DEPLOY / "configs" / "run.toml"))
    assert run_cfg.replicas == 3
    assert read_toml(DEPLOY / "configs" / "run.toml")["run"]["replicas"] == 3  # written, not defaulted


def test_the_cluster_node_config_is_valid_and_fsyncs_before_acknowledging():
    conf = DEPLOY / "nats" / "cluster-node.conf"
    check = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True,
                           env={**os.environ, "NATS_NAME": "nats-1"}, timeout=30)
    assert check.returncode == 0, check.stderr + check.stdout
    jetstream = re.search(r"^jetstream\s*\{(.*?)^\}", conf.read_text(), re.S | re.M)
    assert jetstream is not None, "cluster-node.conf has no jetstream block"
    assert re.search(r"^\s*sync_interval:\s*always\s*$", jetstream.group(1), re.M)
