"""Dead letters: a message that cannot be processed, kept byte for byte with the reason.

Both buses build them here and publish them on ``rl.<run>.dead.<origin kind>``:

- ``reason`` says why (``schema_error``/``decode_error``, ``max_deliveries``, ``claim_missing``,
  or the reason a handler gave with ``Poison``/``Delivery.term``);
- ``error`` carries the detail (the exception text, ``Poison``, the last handler error seen);
- the msg id is ``dead.<stream>.<seq>`` for a stored message, so a dead letter written twice
  (a crash between the dead letter and the ``term``, two replicas acting on one advisory) is
  stored once; a message with no stream position gets a hash of its content instead.
"""

from __future__ import annotations

import hashlib
import time

from rlbus.bus.routing import origin_token
from rlbus.bus.subjects import Subjects
from rlbus.schemas import DeadLetter


def dead_letter_id(stream: str, stream_seq: int) -> str:
    """The msg id of the dead letter of stored message ``stream_seq`` of ``stream``."""
    return f"dead.{stream}.{stream_seq}"


def never_acked(deliveries: int) -> str:
    """The error of a max-deliveries dead letter when no handler error was recorded."""
    return f"delivered {deliveries} times without an ack (the handler failed or outlived ack_wait each time)"


def decode_failure_reason(exc: BaseException) -> str:
    """``schema_error`` for a ``schemas.SchemaError`` (or a subclass), ``decode_error`` otherwise."""
    return "schema_error" if any(c.__name__ == "SchemaError" for c in type(exc).__mro__) else "decode_error"


def build_dead_letter(subjects: Subjects, origin_subject: str, data: bytes, *, error: str, reason: str,
                      deliveries: int, headers: dict[str, str] | None, service: str, msg_id: str | None,
                      stream_seq: int) -> tuple[str, DeadLetter, str]:
    """(subject, letter, msg id) of the dead letter of ``data`` first published on ``origin_subject``."""
    data = bytes(data)
    letter = DeadLetter(
        origin_subject=origin_subject, error=error, reason=reason, data=data, deliveries=deliveries,
        headers={str(k): str(v) for k, v in (headers or {}).items()}, service=service,
        stream_seq=stream_seq, ts=time.time(),
    )
    if msg_id is None:
        h = hashlib.sha256(f"{origin_subject}\0{reason}\0{error}\0".encode() + data).hexdigest()[:32]
        msg_id = f"dead.{h}"
    return subjects.dead(origin_token(origin_subject)), letter, msg_id
