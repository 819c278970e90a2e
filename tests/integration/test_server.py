"""The embedded nats-server: readiness, restart on the same port, clear start-up errors."""

from __future__ import annotations

import pytest

from rlbus.bus.server import EmbeddedServer, ServerError

pytestmark = pytest.mark.integration


def test_start_restart_and_double_stop(tmp_path):
    server = EmbeddedServer(tmp_path / "a")
    server.start()
    try:
        url, pid = server.url, server.pid
        assert url.startswith("nats://127.0.0.1:") and server.running
        assert "max_payload: 8388608" in server.config_path.read_text()
        server.restart()
        assert server.url == url and server.pid != pid  # same port, a new process
    finally:
        server.stop()
        server.stop()
    assert not server.running


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path, nats_server):
    port = int(nats_server.url.rsplit(":", 1)[1])
    clash = EmbeddedServer(tmp_path / "b", port=port, ready_timeout=10)
    with pytest.raises(ServerError) as err:
        clash.start()
    assert "nats-server exited" in str(err.value) and "address already in use" in str(err.value).lower()
    assert not clash.running
