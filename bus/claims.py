"""Claim check: payloads too large for a message travel through the run's object store.

A payload above the connection's ``claim_threshold`` (default: the server's ``max_payload``
less 512 KiB of headroom for headers) is written to the object store as ``claims/<msg_id>`` and
a small reference message (header ``Rlbus-Claim``) is published instead.  Every read path
(consume, puller, watch, last, dead letters) resolves it, so callers only ever see the original
bytes.  Claims of work-queue messages are deleted once the message is acked or terminated;
claims on limits streams live as long as the run's bucket (they are what replay reads).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from bus.protocol import DigestMismatch, ObjectNotFound, ObjectStore

CLAIM_HEADER = "Rlbus-Claim"
CLAIM_SIZE_HEADER = "Rlbus-Claim-Size"


class ClaimCheck:
    """Writes, resolves and releases claimed payloads in one object store."""

    def __init__(self, objects: ObjectStore, *, spawn: Callable[..., asyncio.Task[Any]], log: Any) -> None:
        self.objects = objects
        self._spawn = spawn
        self.log = log

    async def put(self, msg_id: str, data: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
        """Store ``data``; returns the (empty) payload and the headers of the reference message."""
        name = f"claims/{msg_id}"
        info = await self.objects.put(name, data)
        headers = dict(headers)
        headers[CLAIM_HEADER] = name
        headers[CLAIM_SIZE_HEADER] = str(info.size)
        return b"", headers

    async def resolve(self, data: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str], str | None]:
        """(original bytes, headers without the claim headers, claim name or None)."""
        name = headers.get(CLAIM_HEADER)
        if name is None:
            return data, headers, None
        body = await self.objects.get(name)
        headers = {k: v for k, v in headers.items() if k not in (CLAIM_HEADER, CLAIM_SIZE_HEADER)}
        return body, headers, name

    @staticmethod
    def is_gone(exc: BaseException) -> bool:
        """Whether a resolve failure is permanent (the claimed bytes are missing or corrupt)."""
        return isinstance(exc, (ObjectNotFound, DigestMismatch))

    def release(self, name: str) -> None:
        """Delete a claim in the background (its message is gone for good)."""
        self._spawn(self._delete(name), name=f"release-{name}")

    async def _delete(self, name: str) -> None:
        try:
            await self.objects.delete(name)
        except Exception as exc:  # noqa: BLE001 - a leftover claim costs bytes, not correctness
            self.log.warning("claim_release_failed", claim=name, error=repr(exc))
