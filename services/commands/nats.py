"""``rlbus nats``: the embedded JetStream server in the foreground (Ctrl-C stops it)."""

from __future__ import annotations


def run_nats(store: str, port: int) -> int:
    from rlbus.bus.server import EmbeddedServer

    server = EmbeddedServer(store_dir=store, port=port)
    server.run_foreground()
    return 0
