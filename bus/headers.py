"""The headers every published message carries, checked the same way by both buses.

A publish sends ``Nats-Msg-Id`` (the stream's duplicate window stores a retried publish once),
the W3C trace context of the current span (unless the caller's headers name the message's own
trace: a task published in a batch carries its task's trace), and the caller's own headers.  Header keys and
values must be plain strings without CR/LF (they are written verbatim into the NATS protocol
line) and must fit a small budget: ``max_payload`` counts headers too, and the claim check
leaves only a fixed headroom for them.  ``MemoryBus`` applies the same checks so a handler test
fails where the real bus would.
"""

from __future__ import annotations

from collections.abc import Sized

from rlbus.bus.protocol import BusError, PayloadTooLarge
from rlbus.observability.tracing import TRACE_HEADER_BUDGET, inject

KiB = 1024
# User headers plus trace context; the claim threshold leaves far more room than this.
HEADER_BUDGET = 4 * KiB + TRACE_HEADER_BUDGET
MSG_ID = "Nats-Msg-Id"


def header_bytes(headers: dict[str, str]) -> int:
    """Bytes the headers take on the wire (``NATS/1.0`` line plus ``key: value`` lines)."""
    return 12 + sum(len(k) + len(v) + 4 for k, v in headers.items())


def check_item_headers(items: Sized, item_headers: Sized | None) -> None:
    if item_headers is not None and len(item_headers) != len(items):
        raise BusError(f"publish_many got {len(item_headers)} item_headers for {len(items)} items; "
                       "give one dict per item (or none)")


def publish_headers(msg_id: str, extra: dict[str, str] | None) -> dict[str, str]:
    """The headers of one publish: trace context, the caller's ``extra`` and the msg id."""
    if not msg_id:
        raise BusError("every publish needs a msg_id (it is what makes retries safe)")
    h = inject(extra)
    h[MSG_ID] = msg_id
    if extra:
        for k, v in extra.items():
            if not isinstance(v, str) or "\r" in v or "\n" in v or "\r" in k or "\n" in k or ":" in k:
                raise BusError(f"header {k!r} must be a str key/value without CR/LF (and no ':' in the key)")
        if header_bytes(h) > HEADER_BUDGET:
            raise PayloadTooLarge(
                f"headers of msg {msg_id!r} take {header_bytes(h)} bytes, over the {HEADER_BUDGET}-byte "
                "budget; put large metadata in the payload"
            )
    return h
