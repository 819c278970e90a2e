"""The bus: every service talks to every other only through this package (and only it imports nats).

Public names:
- the contract: ``Bus``, ``ConsumerSpec``, ``Delivery``, ``Puller``, ``ObjectStore``, ``ObjectInfo``,
  ``Retry``/``Poison`` outcomes, ``StreamState``/``ConsumerState`` and the ``BusError`` family;
- ``open_bus(url, run, name=...)`` -> a real JetStream bus (``rlbus.bus.jetstream.JetStreamBus``);
- ``MemoryBus`` for handler tests; ``EmbeddedServer`` for ``rlbus up``/``rlbus nats``/tests;
- ``Subjects``: every subject, stream, durable and bucket name of a run.

``rlbus.bus.jetstream``/``rlbus.bus.memory``/``rlbus.bus.server`` are imported lazily so importing ``bus`` stays cheap.

Inside the package: ``JetStreamBus`` (``rlbus.bus.jetstream``) is a thin front over one ``Connection``
(``rlbus.bus.connection``: the nats client, streams, publisher, claim check, dead letters, background
tasks); ``rlbus.bus.consume`` (the consume loop), ``rlbus.bus.puller`` and ``rlbus.bus.watch`` work only through
the connection's public methods.  Both buses share the decode step and the handler outcome rules
(``rlbus.bus.outcome``), dead-letter records (``rlbus.bus.deadletter``) and header checks (``rlbus.bus.headers``);
``rlbus.bus.heartbeat`` keeps held deliveries alive on the real server; ``rlbus.bus.retention`` holds the
streams' limits and ``rlbus.bus.advisories`` turns captured max-deliveries advisories into dead letters.  ``rlbus.bus.baseline`` is the raw
nats-py client the bus benchmark compares against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlbus.bus.connect import open_bus
from rlbus.bus.protocol import (
    BadObjectName,
    Bus,
    BusClosed,
    BusConfigError,
    BusError,
    ConsumerSpec,
    ConsumerState,
    Delivery,
    DigestMismatch,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    PayloadTooLarge,
    Poison,
    PublishTimeout,
    Puller,
    RequestFailed,
    Retry,
    ServerUnavailable,
    StreamFull,
    StreamState,
)
from rlbus.bus.subjects import SubjectError, Subjects

if TYPE_CHECKING:
    from rlbus.bus.jetstream import JetStreamBus
    from rlbus.bus.memory import MemoryBus
    from rlbus.bus.server import EmbeddedServer, ServerError

__all__ = [
    "BadObjectName", "Bus", "BusClosed", "BusConfigError", "BusError", "ConsumerSpec", "ConsumerState", "Delivery",
    "DigestMismatch", "EmbeddedServer", "JetStreamBus", "MemoryBus", "ObjectInfo", "ObjectNotFound",
    "ObjectStore", "PayloadTooLarge", "Poison", "PublishTimeout", "Puller", "RequestFailed", "Retry",
    "ServerError", "ServerUnavailable", "StreamFull", "StreamState", "SubjectError", "Subjects", "open_bus",
]


def __getattr__(name: str) -> Any:
    if name == "JetStreamBus":
        from rlbus.bus.jetstream import JetStreamBus

        return JetStreamBus
    if name == "MemoryBus":
        from rlbus.bus.memory import MemoryBus

        return MemoryBus
    if name in ("EmbeddedServer", "ServerError", "run_foreground"):
        import rlbus.bus.server as server

        return getattr(server, name)
    raise AttributeError(f"module 'bus' has no attribute {name!r}")
