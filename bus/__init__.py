"""The bus: every service talks to every other only through this package (and only it imports nats).

Public names:
- the contract: ``Bus``, ``ConsumerSpec``, ``Delivery``, ``Puller``, ``ObjectStore``, ``ObjectInfo``,
  ``Retry``/``Poison`` outcomes, ``StreamState``/``ConsumerState`` and the ``BusError`` family;
- ``open_bus(url, run, name=...)`` -> a real JetStream bus (``bus.jetstream.JetStreamBus``);
- ``MemoryBus`` for handler tests; ``EmbeddedServer`` for ``rlbus up``/``rlbus nats``/tests;
- ``Subjects``: every subject, stream, durable and bucket name of a run.

``bus.jetstream``/``bus.server`` are imported lazily so importing ``bus`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bus.connect import open_bus
from bus.memory import MemoryBus
from bus.protocol import (
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
    StreamState,
)
from bus.subjects import SubjectError, Subjects

if TYPE_CHECKING:
    from bus.jetstream import JetStreamBus
    from bus.server import EmbeddedServer, ServerError

__all__ = [
    "Bus", "BusClosed", "BusConfigError", "BusError", "ConsumerSpec", "ConsumerState", "Delivery",
    "DigestMismatch", "EmbeddedServer", "JetStreamBus", "MemoryBus", "ObjectInfo", "ObjectNotFound",
    "ObjectStore", "PayloadTooLarge", "Poison", "PublishTimeout", "Puller", "RequestFailed", "Retry",
    "ServerError", "StreamState", "SubjectError", "Subjects", "open_bus",
]


def __getattr__(name: str) -> Any:
    if name == "JetStreamBus":
        from bus.jetstream import JetStreamBus

        return JetStreamBus
    if name in ("EmbeddedServer", "ServerError", "run_foreground"):
        import bus.server as server

        return getattr(server, name)
    raise AttributeError(f"module 'bus' has no attribute {name!r}")
