"""The shipped NATS and run configs keep the durability and replica promises: the cluster node's
config passes ``nats-server -t`` and fsyncs before it acknowledges, and the shared run config
asks for no more copies than the single server the systemd units run can hold (the compose file
raises them to three through its environment: tests/deploy/test_compose.py)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from rlbus.bus.server import find_nats_server
from rlbus.services.runtime.config import RunSettings, load_section, read_toml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_the_cluster_node_config_is_valid_and_fsyncs_before_acknowledging():
    conf = DEPLOY / "nats" / "cluster-node.conf"
    check = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True,
                           env={**os.environ, "NATS_NAME": "nats-1"}, timeout=30)
    assert check.returncode == 0, check.stderr + check.stdout
    jetstream = re.search(r"^jetstream\s*\{(.*?)^\}", conf.read_text(), re.S | re.M)
    assert jetstream is not None, "cluster-node.conf has no jetstream block"
    assert re.search(r"^\s*sync_interval:\s*always\s*$", jetstream.group(1), re.M)


def test_the_shared_run_config_fits_a_single_server(monkeypatch):
    for key in [k for k in os.environ if k.startswith("RLBUS_")]:
        monkeypatch.delenv(key)
    run = load_section(RunSettings, read_toml(DEPLOY / "configs" / "run.toml"), "run")
    assert run.replicas == 1  # a single server refuses more; the cluster's services set 3 in their environment
