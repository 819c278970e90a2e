"""What a request to the server that went unanswered looks like, and how an operation rides out
an outage: one place for the publisher's sibling operations (object store, stream info).

``api_errors`` turns nats-py's own errors for an unanswered JetStream API request into
``ServerUnavailable`` (a ``BusError`` services handle); ``through_outage`` repeats an idempotent
operation while the server is away, bounded like a publish (``rlbus.bus.publish``): by time with the
server reachable (``deadline``) and by time disconnected (``outage``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import nats.errors
from nats.js.errors import ServiceUnavailableError

from rlbus.bus.protocol import BusClosed, ServerUnavailable

T = TypeVar("T")
RECONNECT_POLL_S = 0.25
UNANSWERED = (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError,
              ServiceUnavailableError, nats.errors.OutboundBufferLimitError)


@contextlib.contextmanager
def api_errors(what: str) -> Iterator[None]:
    """A request the server did not answer (down, restarting) as ``ServerUnavailable``, a closed
    connection as ``BusClosed``: errors services handle, instead of nats-py's own escaping the bus
    and killing the task that asked."""
    try:
        yield
    except UNANSWERED as exc:
        raise ServerUnavailable(f"{what}: the NATS server did not answer ({type(exc).__name__}); "
                                "it is down or restarting, try again later") from exc
    except nats.errors.ConnectionClosedError:
        raise BusClosed(f"{what}: the connection is closed") from None


async def through_outage(op: Callable[[], Awaitable[T]], what: str, *, connected: Callable[[], bool],
                         deadline: float, outage: float) -> T:
    """Run the idempotent ``op`` until it succeeds.  While the client is disconnected nothing is
    tried (for up to ``outage`` seconds in all); an attempt the server leaves unanswered is tried
    again after a backoff, for up to ``deadline`` seconds of reachable time; past either,
    ``ServerUnavailable`` goes to the caller."""
    start, away, delay = time.monotonic(), 0.0, 0.1
    while True:
        away += await _wait_connected(what, connected, outage - away)
        t0 = time.monotonic()
        try:
            with api_errors(what):
                return await op()
        except ServerUnavailable:
            if not connected():  # the server went away during the attempt: that time was outage
                away += time.monotonic() - t0
                continue
            if time.monotonic() - start - away > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def _wait_connected(what: str, connected: Callable[[], bool], budget: float) -> float:
    """Seconds waited for the connection; ``ServerUnavailable`` once ``budget`` is spent."""
    t0 = time.monotonic()
    while not connected():
        if time.monotonic() - t0 > budget:
            raise ServerUnavailable(f"{what}: the NATS server has been unreachable past the outage budget "
                                    "([run] publish_outage_s); bring it back or raise the budget")
        await asyncio.sleep(RECONNECT_POLL_S)
    return time.monotonic() - t0
